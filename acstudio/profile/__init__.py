"""The measured profile of one captured training iteration: the data model every other part reads."""

from acstudio.profile.model import (
    CATEGORIES,
    REGIONS,
    ActivationRecord,
    NodeRecord,
    Profile,
    TensorRecord,
)

__all__ = ["CATEGORIES", "REGIONS", "ActivationRecord", "NodeRecord", "Profile", "TensorRecord"]
