"""Data for training and evaluation: synthetic tasks, Shakespeare, tokenizer, JSONL loading."""
