"""Answer scoring the task YAMLs use (`process_results`)."""

import re


# ---- MATH-500 ------------------------------------------------------------------------------------------
def last_boxed(text: str):
    i = text.rfind("\\boxed")
    if i < 0:
        return None
    j = text.find("{", i)
    if j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[j + 1:k]
    return None


def normalize_math(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace(" ", "")
    return s.rstrip(".")


def math500_process_results(doc, results):
    text = results[0]
    ans = last_boxed(text)
    if ans is None:
        m = re.search(r"answer is\s*\$?([^\n$]+)", text)
        ans = m.group(1) if m else text.strip().split("\n")[-1] if text.strip() else ""
    return {"exact_match": int(normalize_math(ans) == normalize_math(doc["answer"]))}
