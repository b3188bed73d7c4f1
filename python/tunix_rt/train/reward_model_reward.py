"""A reward model as a GRPO/PPO reward function (`--reward-model PATH`, TRL's reward_funcs taking a sequence
classifier): each prompt and completion scored in-process, as one conversation rendered by the reward model's
own chat template (its tokenizer may differ from the policy's: the text is re-rendered, as TRL does) or, for
plain rows, as the prompt text followed by the completion's; read at the last token, batched."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tunix_rt.models.sequence_scores import SequenceScorer


class RewardModelReward:
    """f(prompts, completions, **columns) -> one float per completion, TRL's reward convention."""

    def __init__(self, path: str, *, max_length: int | None = None):
        from tunix_rt.checkpoints.loader import load_model

        loaded = load_model(path)
        if loaded.model.config.num_labels != 1:
            raise ValueError(f"--reward-model {path}: not a reward model (a sequence classifier with one output), "
                             f"its num_labels is {loaded.model.config.num_labels}")
        self.tokenizer = loaded.tokenizer
        self.scorer = SequenceScorer(loaded.model)
        self.head = np.asarray(loaded.model.score.kernel.get_value())  # (D, 1): where PPO's critic may start
        self.max_length = max_length or loaded.model.config.max_position_embeddings
        parts = Path(path).resolve().parts
        self.name = "reward_model:" + "/".join(parts[-2:])  # a run's DIR/final as "DIR/final"

    def tokens(self, prompt, completion) -> list[int]:
        if isinstance(prompt, list):  # a conversation: the reward model's template renders it whole
            completion = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            text = self.tokenizer.apply_chat_template(prompt + completion, add_generation_prompt=False)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = self.tokenizer.encode(prompt + (completion if isinstance(completion, str) else
                                                  "".join(m.get("content") or "" for m in completion)))
        return ids[-self.max_length:]  # the reward is read at the last token: a long one keeps its end

    def __call__(self, prompts, completions, **columns) -> list[float]:
        scores = self.scorer([self.tokens(p, c) for p, c in zip(prompts, completions)])
        return [float(s) for s in scores[:, 0]]
