"""FSDP2's "returned a view tensor" warning is silenced for LongStraw's units (their state pieces are views the
engine never modifies in place; the LM head's log-probs alike) and for nothing else."""

import warnings

from longstraw.distributed.fsdp import _quiet_view_warning

TAIL = " returned a view tensor. An in-place op on this view (e.g., `x += y`) will silently drop the pre-backward hook"


def test_only_our_units_view_warning_is_silenced():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_view_warning()
        for cls in ("FSDPDecoderLayer", "FSDPBackbone", "FSDPEmbedding, FSDPLMHead", "FSDPLMHead", "FSDPLinear",
                    "FSDPMyBlock", "FSDPEmbedding, FSDPMyBlock"):
            warnings.warn(f"FSDP2-wrapped module ({cls})" + TAIL, UserWarning)
        warnings.warn("something else entirely", UserWarning)
    assert [str(w.message).split(")")[0] for w in seen] == ["FSDP2-wrapped module (FSDPLinear",
                                                             "FSDP2-wrapped module (FSDPMyBlock",
                                                             "FSDP2-wrapped module (FSDPEmbedding, FSDPMyBlock",
                                                             "something else entirely"]
