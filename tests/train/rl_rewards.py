"""Reward functions the RL tests load as module:function."""


def low_ids(prompts, completions, completion_ids, **columns):
    """The fraction of a completion's tokens with id < 64: a dense signal a tiny random model can learn."""
    return [sum(t < 64 for t in ids) / max(len(ids), 1) for ids in completion_ids]
