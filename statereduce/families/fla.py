"""What the fla families (DeltaNet, Gated DeltaNet) share: fla's hybrid layer layout and q/k convolutions of their
own."""

from __future__ import annotations

from statereduce.families.base import FamilySpec, RftTargets


class FlaFamily(FamilySpec):
    """An fla linear-attention family: softmax-attention layers of fla hybrids (``config.attn``) are not mixers."""

    speed_benchmark = True
    rft_targets = RftTargets()  # every decoder block and the final norm (the paper's RFT of DeltaNet / Gated DeltaNet)
    qk_conv_modules = True
    config_overrides = {"fuse_cross_entropy": False}  # fla's fused loss is CUDA-only; the plain loss is exact
    norm_eps_field = "norm_eps"  # block norms, o_norm and the final norm (and attnres' norms) all read it

    @classmethod
    def exact_norm_eps_refusal(cls, config) -> str | None:
        """Also refuses attention-residual blocks (``attnres_block_size``): their ``fused_attnres`` kernel mixes the
        residuals under norms of its own, which the construction does not check (and which have no CPU path)."""
        if getattr(config, "attnres_block_size", None) is not None:
            return "attention-residual blocks (attnres_block_size) are not covered"
        return super().exact_norm_eps_refusal(config)

    @classmethod
    def mixer_layer_indices(cls, config) -> list[int]:
        """Every layer without a softmax-attention spec; a config without ``attn`` (no hybrid) needs no fla import."""
        if getattr(config, "attn", None) is None:
            return list(range(config.num_hidden_layers))
        from fla.models.configuration_utils import get_attention_spec

        return [i for i in range(config.num_hidden_layers) if get_attention_spec(config.attn, layer_idx=i) is None]
