"""`clover serve --backend llamacpp`: the server's scheduler and engines decoding on the patched
llama.cpp runner answer completions and chat completions exactly as the PyTorch back end does
(greedy; ar, low_confidence and self_spec; several prompts in one batch). Skipped without the build."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from clover.backends.llamacpp import SAMPLE_PROMPTS, find_build  # noqa: E402

pytestmark = pytest.mark.skipif(find_build(variant="clover") is None, reason="no patched llama.cpp build (make llamacpp)")

from server_utils import RunningServer, client  # noqa: E402
from test_gguf_export import DEFAULT  # noqa: E402


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(torch server, llama.cpp server) on the shipped model, the same settings."""
    import clover
    from clover.api import eos_ids
    from clover.backends.gguf_export import export_gguf
    from clover.backends.llamacpp.model import LlamaCppModel
    from clover.server import Settings, create_app

    path = tmp_path_factory.mktemp("serve-gguf") / "default.gguf"
    export_gguf(DEFAULT, path, "f32")
    model, tok = clover.load(DEFAULT, "cpu")
    runner = LlamaCppModel(path, model.config, max_rows=4, parity=True)
    settings = dict(model_id="m", block_size=8, threshold=0.9, max_batch=4, max_queue=16)
    apps = [create_app(m, tok, Settings(**settings), eos_ids(m, tok)) for m in (model, runner)]
    with RunningServer(apps[0]) as a, RunningServer(apps[1]) as b:
        yield a, b
    runner.close()


@pytest.mark.parametrize("mode", ["ar", "low_confidence", "self_spec"])
def test_completions_and_chat_equal_torch_backend(servers, mode):
    extra = {"mode": mode, "block_size": 8}
    prompts = SAMPLE_PROMPTS[:3]  # one request, three rows batched in one engine
    out = []
    for s in servers:
        c = client(s)
        comp = c.completions.create(model="m", prompt=prompts, max_tokens=20, temperature=0, extra_body=extra)
        chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": SAMPLE_PROMPTS[5]}],
                                         max_tokens=16, temperature=0, extra_body=extra)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model="m", prompt=SAMPLE_PROMPTS[7], max_tokens=16, temperature=0, stream=True, extra_body=extra))
        out.append(([(ch.index, ch.text, ch.finish_reason) for ch in sorted(comp.choices, key=lambda x: x.index)],
                    chat.choices[0].message.content, comp.usage.completion_tokens, streamed))
    assert out[0] == out[1]
    assert out[1][2] > 3 and any(text for _, text, _ in out[1][0])  # real output, not empty
