"""Inductor's choices for FlexAttention, plus one 64 x 64 config (imported only on the GPU).

Its default Hopper configs tile 128 queries (forward) and 128 keys (backward); a BlockMask of
64-token blocks cannot use those, and with no other config the compile fails. ``Block64Choices``
adds a 64 x 64 config to the defaults (forward and backward); configs that fit a mask are kept,
so 128-token masks still get the defaults. It is a module-level class so that inductor's
config (``inductor_choices_class``, global: the backward compiles in autograd's thread) can
pickle it for its cache key.
"""
from __future__ import annotations

from torch._inductor.choices import InductorChoices
from torch._inductor.template_heuristics.triton import FlexBwDConfig, FlexConfig

FWD_64 = FlexConfig(64, 64, 3, 4)
BWD_64 = FlexBwDConfig(64, 64, 64, 64, 3, 4)


class Block64Choices(InductorChoices):
    def get_flex_attention_fwd_configs(self, head_dim, dtype, device_type="cuda"):
        configs = list(super().get_flex_attention_fwd_configs(head_dim, dtype, device_type))
        return configs + ([FWD_64] if FWD_64 not in configs else [])

    def get_flex_attention_bwd_configs(self, head_dim, dtype, device_type="cuda"):
        configs = list(super().get_flex_attention_bwd_configs(head_dim, dtype, device_type))
        return configs + ([BWD_64] if BWD_64 not in configs else [])


def install() -> None:
    from torch._inductor import config
    from torch._inductor.virtualized import V

    config.inductor_choices_class = Block64Choices
    V.set_choices_handler(Block64Choices())  # this thread may have made its handler already
