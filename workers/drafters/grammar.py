"""Grammar drafting: a guided request's forced tokens as the draft (SGLang's jump-forward).

Where a request's format leaves no choice (a JSON schema's next key and its quotes, the
punctuation between fields, the rest of the one enum value a prefix allows) the grammar knows the
text that must come; llguidance tokenizes it as the tokenizer would (`compute_ff_tokens`, which
stops before a token that could merge with free text after it). The drafter proposes those
tokens; the target verifies them like any draft, so the output stays the target's (it may spell
the forced text with other tokens, which the masks allow). Training-free and cheap, so the router
scores it every step; it proposes nothing for a request without a format, or where the grammar
leaves a choice.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from workers.config import GrammarDrafterConfig
from workers.drafters.base import Draft, DraftContext


class GrammarDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = True

    def __init__(self, config: GrammarDrafterConfig) -> None:
        self.config = config
        self.name = config.name
        self._empty = torch.empty(0, dtype=torch.long)

    def begin(self, ctx: DraftContext) -> None:
        return None

    def propose(self, state: None, ctx: DraftContext, k: int) -> Draft:
        if ctx.guide is None:
            return Draft(self._empty)
        return Draft(torch.tensor(ctx.guide.forced()[:k], dtype=torch.long))

    def commit(self, state: None, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass  # the grammar follows the output (the engine advances it)

    def end(self, state: None) -> None:
        pass
