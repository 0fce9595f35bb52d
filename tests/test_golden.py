"""The decoding core's outputs are the recorded ones (tests/golden.py, tests/golden.json): token ids,
forward counts, decide answers, structured output and server replies, unchanged by refactors."""

import json

from golden import GOLDEN, differences, record


def test_outputs_equal_the_recorded_golden_outputs():
    diff = differences(json.loads(GOLDEN.read_text()), record())
    assert not diff, "outputs differ from tests/golden.json:\n" + "\n".join(diff[:20])
