"""Training recipes for the small real model pair (`models/kimi-mini`): tokenizer, target, drafter, evaluation."""
