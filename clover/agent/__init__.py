"""Agent features: the tool-call prompt format and parser, the local toolbox and its seeded
dialogues (training data and the agent benchmark)."""
