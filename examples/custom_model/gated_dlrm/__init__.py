"""An example model package for recsys: a DLRM whose interaction is a gated cross network."""

from gated_dlrm.model import GatedDLRM

__all__ = ["GatedDLRM"]
