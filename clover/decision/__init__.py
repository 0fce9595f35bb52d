"""Joint decision mode: up to 8 questions about one material answered in one
denoising process. Design and slot layout: docs/decide.md.

    answers = clover.decide(model, tokenizer, material, [
        {"question": "Who is the oldest?", "options": ["Ann", "Bob"]},
        {"question": "Is Ann older than Bob?", "type": "boolean"},
        {"question": "How old is Bob?", "type": "integer", "max_tokens": 2},
    ])
"""

from .decide import (
    MAX_QUESTIONS,
    MODES,
    TYPES,
    Answer,
    Decision,
    Question,
    decide,
    parse_question,
    parse_questions,
)

__all__ = ["MAX_QUESTIONS", "MODES", "TYPES", "Answer", "Decision", "Question", "decide", "parse_question",
           "parse_questions"]
