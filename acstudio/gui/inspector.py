"""The inspector: the selected node, or the open profile, what sets the floor and the current plan's peak, what the
plan moves over the host link, and the link itself (measured, or the stated default).

Bound to the :class:`~acstudio.views.session.Session`. It follows a plan once the budget rests for
:data:`INSPECTOR_DELAY_MS` (laying out its HTML costs about a slider step), and the profile's part only once the
plan's timeline is simulated: until then it keeps what it shows rather than blinking on every step.
"""

from __future__ import annotations

import html

import numpy as np
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QTextBrowser, QWidget

from acstudio.plan.peak import explain_peak
from acstudio.units import format_bytes
from acstudio.views.documents import Loaded
from acstudio.views.offload import link_note, link_rows, on_gpu, plan_offload_text
from acstudio.views.session import Session

INSPECTOR_DELAY_MS = 150


class Inspector(QTextBrowser):
    def __init__(self, session: Session, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.session = session
        self.setMinimumHeight(220)
        self._html = ""
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(INSPECTOR_DELAY_MS)
        self._timer.timeout.connect(self.refresh)
        session.events.loaded.connect(lambda loaded: self._show(self._profile_html(loaded)))
        session.events.plan.connect(lambda _state: self._timer.start())
        session.events.floor_note.connect(lambda _note: self.refresh())
        session.events.selection.connect(lambda node_id: self._show(self._node_html(node_id)))

    @property
    def pending(self) -> bool:
        """A plan is shown that the inspector will follow soon."""
        return self._timer.isActive()

    def refresh(self) -> None:
        """The selected node, or the profile and what sets the current plan's peak (once simulated)."""
        state = self.session.state
        if self.session.selected:
            self._show(self._node_html(self.session.selected))
        elif state is not None and state.complete:
            self._show(self._profile_html(self.session.loaded))

    def _show(self, text: str) -> None:
        self._timer.stop()
        if text != self._html:  # setHtml lays the whole document out again: a few ms
            self._html = text
            self.setHtml(text)

    def _profile_html(self, loaded: Loaded) -> str:
        p = loaded.profile
        env = p.environment
        cats = "".join(f"<tr><td>{k}</td><td align=right>{format_bytes(v)}</td></tr>"
                       for k, v in p.peak_breakdown.items() if v)
        note = loaded.floor_note
        floor = f"<p>{html.escape(note[:1].upper() + note[1:])}.</p>" if note else ""
        return (f"<h3>{p.label}</h3><p>{len(p.nodes)} nodes · {len(p.activations)} activations · "
                f"iteration {p.iteration_ms:.1f} ms<br>device {env.get('device', '?')} · torch "
                f"{env.get('torch', '?')}</p><p>measured peak {format_bytes(p.peak_bytes)} at {p.peak_node}<br>"
                f"checkpointing floor {format_bytes(self.session.floor_bytes)}</p>"
                f"<table><tr><th align=left>at the peak</th><th></th></tr>{cats}</table>"
                f"{floor}{self._plan_peak_html()}{self._link_html(loaded)}"
                "<p>Click a node in the graph, the timeline or the table.</p>")

    def _link_html(self, loaded: Loaded) -> str:
        """The host link offload is priced with, and the stated default where the profile has none."""
        profile = loaded.profile
        if not on_gpu(profile):
            return "<p><b>Host link:</b> none on a CPU device (host memory is its memory): nothing is offloaded.</p>"
        rows = "".join(f"<tr><td>{k}</td><td align=right>{v}</td></tr>" for k, v in link_rows(profile))
        note = link_note(profile)
        note = f"<p>{html.escape(note[:1].upper() + note[1:])}.</p>" if note else ""
        return (f"<table><tr><th align=left>host link</th><th></th></tr>{rows}<tr><td>plans offload up to</td>"
                f"<td align=right>{format_bytes(loaded.ctx.host_memory)}</td></tr></table>{note}")

    def _plan_peak_html(self) -> str:
        """What sets the current plan's peak (once its timeline is simulated)."""
        state, loaded = self.session.state, self.session.loaded
        if state is None or not state.complete:
            return ""
        moved = plan_offload_text(state.plan)
        moved = f"<br>It {html.escape(moved)}." if moved else ""
        return (f"<p><b>This plan:</b> {html.escape(explain_peak(loaded.ctx, state.plan, state.sim).summary())}"
                f"{moved}</p>")

    def _node_html(self, node_id: str) -> str:
        loaded = self.session.loaded
        n = loaded.profile.node_by_id[node_id]
        rows = [("op", n.target), ("module", n.module or "–"), ("region", n.region), ("shape", f"{n.shape} {n.dtype}"),
                ("allocates", format_bytes(n.new_bytes)), ("run time", f"{n.run_time_ms:.3f} ms")]
        device_ms = loaded.profile.node_device_ms
        if device_ms is not None:  # the rest of the run time is the host launching the node
            rows.append(("device time", f"{device_ms[loaded.profile.node_index[node_id]]:.3f} ms"))
        rows += [("memory after", format_bytes(n.mem_after)), ("memory peak", format_bytes(n.mem_peak)),
                 ("replay", n.replay)]
        state = self.session.state
        entries = {e.activation: e for e in state.plan.schedule} if state else {}
        for a in loaded.profile.activations:
            if a.created_at != node_id:
                continue
            decision = state.decisions.get(a.id, "") if state else ""
            rows += [("activation", f"{a.id}: {format_bytes(a.bytes)}"), ("decision", decision),
                     ("last forward use", a.last_fw_use), ("first backward use", a.first_bw_use),
                     ("inactive", f"{a.inactive_time_ms:.3f} ms")]
            entry = entries.get(a.id)
            rows += self._copy_rows(a.id)
            if entry is not None:
                rows += [("recomputed before", entry.recompute_before), ("sources", " ".join(entry.sources) or "–"),
                         ("replays", f"{len(entry.replay)} nodes, {entry.recompute_ms:.3f} ms"),
                         ("ratio", f"{entry.ratio / 2**20:.2f} MiB/ms")]
        if state:
            inserted = [e.activation for e in state.plan.schedule if e.recompute_before == node_id]
            if inserted:
                rows.append(("recomputes before it", " ".join(inserted)))
        body = "".join(f"<tr><td><b>{k}</b></td><td>{v}</td></tr>" for k, v in rows)
        return f"<h3>{n.id} · {n.name}</h3><table cellspacing=3>{body}</table>"

    def _copy_rows(self, activation: str) -> list[tuple[str, str]]:
        """Where the simulated step copies an offloaded activation to the host and back, and when."""
        state, loaded = self.session.state, self.session.loaded
        offload = state.sim.offload if state is not None and state.sim is not None else None
        if offload is None:
            return []
        at = np.flatnonzero(offload.offloaded == loaded.acts.row[activation])
        if not at.size:
            return []
        j, ids = int(at[0]), loaded.simulator.node_ids
        (out0, out1), (in0, in1) = offload.d2h[j], offload.h2d[j]
        return [("to the host", f"{out0:.3f}–{out1:.3f} ms, freed before {ids[offload.release[j]]}"),
                ("back to the device", f"{in0:.3f}–{in1:.3f} ms, issued before {ids[offload.prefetch[j]]}")]
