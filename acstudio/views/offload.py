"""What the app says about offload: the profile's host link (as measured, or the stated default where the
profile has none) and what a plan moves over it. No Qt in here: the inspector and the status bar show these
sentences, and tests read them."""

from __future__ import annotations

from acstudio.plan.model import Plan
from acstudio.profile.model import DEFAULT_HOST_FREE_BYTES, DEFAULT_LINK_GB_S, Profile
from acstudio.units import format_bytes

DEFAULT_MARK = " (default)"


def on_gpu(profile: Profile) -> bool:
    """Whether the profile's device has a host link to offload over (on a CPU the host memory is the device's)."""
    return profile.environment.get("device_type", "cpu") != "cpu"


def link_rows(profile: Profile) -> list[tuple[str, str]]:
    """The host link offload is priced with, as (what, value) rows; a value the profile lacks is the default,
    marked so."""
    link = profile.host_link
    measured = {"d2h": link.d2h_gb_s, "h2d": link.h2d_gb_s, "duplex": link.duplex_gb_s,
                "host": link.host_free_bytes} if link is not None else {}

    def rate(key: str, value: float) -> str:
        return f"{value:.1f} GB/s" + ("" if measured.get(key) is not None else DEFAULT_MARK)

    priced = profile.link
    host = format_bytes(priced.host_bytes) + ("" if measured.get("host") is not None else DEFAULT_MARK)
    return [("device to host", rate("d2h", priced.d2h_rate)), ("host to device", rate("h2d", priced.h2d_rate)),
            ("both at once, each way", rate("duplex", priced.duplex_rate)), ("host memory free", host)]


def link_note(profile: Profile) -> str:
    """A sentence saying that offload is priced with the stated default link, where a GPU profile has no measured
    one ("" where the link was measured, or on a CPU, where nothing is offloaded)."""
    link = profile.host_link
    if not on_gpu(profile) or (link is not None and link.measured and link.host_free_bytes is not None):
        return ""
    default = f"{DEFAULT_LINK_GB_S:g} GB/s each way, {format_bytes(DEFAULT_HOST_FREE_BYTES)} of free host memory"
    if link is None:
        return f"host link not measured in this profile: offload is priced with the stated default ({default})"
    return f"host link partly measured in this profile: the stated default ({default}) fills in what is missing"


def plan_offload_text(plan: Plan) -> str:
    """What ``plan`` moves over the host link and whether the copies hide behind compute ("" if it offloads
    nothing)."""
    if not plan.offloaded:
        return ""
    n = len(plan.offloaded)
    hidden = ("the copies hide behind compute" if plan.copies_hidden
              else f"the copies stall the step by {plan.offload_stall_ms:.2f} ms")
    return (f"offloads {n} activation{'s' * (n != 1)}: {format_bytes(plan.offload_bytes)} cross the link each way "
            f"({format_bytes(plan.host_bytes)} of pinned host memory); {hidden}")
