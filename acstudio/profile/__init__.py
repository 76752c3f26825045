"""The measured profile of one captured training iteration: the data model every other part reads."""

from acstudio.profile.model import ActivationRecord, NodeRecord, Profile, TensorRecord
from acstudio.profile.vocabulary import CATEGORIES, REGIONS

__all__ = ["CATEGORIES", "REGIONS", "ActivationRecord", "NodeRecord", "Profile", "TensorRecord"]
