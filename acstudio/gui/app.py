"""Entry point of the desktop app: ``acstudio [FILE]`` and ``acstudio --screenshot OUT.png [FILE]``.

With no file the bundled sample profile opens (measured on a GPU, so the whole app can be explored on any
machine). ``--screenshot`` renders the window with a plan at a mid budget to a PNG and exits; it works
without a display (offscreen platform) and never touches the user's settings.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import acstudio

PREFERRED_SAMPLE = "h200_resnet152_bs64_adam.json.gz"
USAGE = "usage: acstudio [FILE] | acstudio --screenshot OUT.png [FILE]"


def sample_dirs() -> list[Path]:
    """Where sample profiles live: the repository checkout, then the installed wheel."""
    package = Path(acstudio.__file__).resolve().parent
    return [package.parent / "sample_profiles", package / "sample_profiles"]


def default_profile_path() -> Path | None:
    """The GPU-measured ResNet-152 sample if bundled, else any other bundled profile (GPU ones first)."""
    found: list[Path] = []
    for folder in sample_dirs():
        if (folder / PREFERRED_SAMPLE).is_file():
            return folder / PREFERRED_SAMPLE
        found += sorted(folder.glob("*.json.gz")) if folder.is_dir() else []
    found.sort(key=lambda p: (not p.name.startswith(("h200", "gpu", "cuda", "a100", "h100")), p.name))
    return found[0] if found else None


def parse_args(argv: list[str]) -> tuple[str | None, str | None]:
    """``(screenshot path or None, file or None)``; raises ``ValueError`` with the usage line."""
    args = list(argv)
    shot = None
    if args and args[0] == "--screenshot":
        if len(args) < 2:
            raise ValueError(USAGE)
        shot, args = args[1], args[2:]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        raise ValueError(USAGE)
    return shot, (args[0] if args else None)


def main(argv: list[str]) -> int:
    try:
        shot, path = parse_args(argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if shot is not None and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

    from PySide6.QtWidgets import QApplication

    from acstudio.gui.main_window import MainWindow
    from acstudio.gui.qtcompat import make_singletons_immortal

    make_singletons_immortal()
    app = QApplication.instance() or QApplication(["acstudio"])
    app.setApplicationName("acstudio")
    app.setOrganizationName("AC Studio")
    target = Path(path) if path else default_profile_path()
    if shot is not None:
        return screenshot(shot, target)
    window = MainWindow()
    window.show()
    if target is not None:
        window.open_path(str(target))
    else:
        window.show_status("No sample profile found: use File › New profile or File › Open")
    return app.exec()


def screenshot(out: str, target: Path | None) -> int:
    """Render the main window on ``target`` with the plan at a mid budget, save it to ``out``."""
    from PySide6.QtCore import QSettings

    from acstudio.gui.dialogs import Messages
    from acstudio.gui.main_window import MainWindow

    class _Print(Messages):
        def error(self, title: str, message: str, details: str = "") -> None:
            print(f"{title}: {message}", file=sys.stderr)

        def info(self, title: str, message: str) -> None:
            print(f"{title}: {message}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        settings = QSettings(os.path.join(tmp, "settings.ini"), QSettings.Format.IniFormat)
        window = MainWindow(settings=settings, messages=_Print(None))
        window.resize(1600, 1000)
        window.show()
        if target is None:
            print("no profile to show: pass FILE or bundle sample_profiles/", file=sys.stderr)
            return 1
        window.open_path(str(target))
        if not window.wait_idle(300) or window.session.loaded is None:
            window.close()
            return 1
        window.wait_idle(120)
        ok = window.grab().save(out)
        window.close()
    if ok:
        print(out)
    return 0 if ok else 1
