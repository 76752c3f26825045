"""Entry point of the desktop app: ``acstudio [FILE]`` and ``acstudio --screenshot OUT.png [FILE]``.

With no file the bundled sample profile opens (measured on a GPU, so the whole app can be explored on any
machine). ``--screenshot`` renders the window with a plan at a mid budget to a PNG and exits; it works
without a display (offscreen platform) and never touches the user's settings.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from pathlib import Path

import acstudio
from acstudio.errors import ACStudioError
from acstudio.fileio import check_output, png_kind

PREFERRED_SAMPLE = "h200_resnet152_bs64_adam.json.gz"
# What Qt's xcb platform plugin loads beyond Qt itself, and the Debian package of each. Without one of these
# Qt aborts the process (rc 134) and its hint names a different package.
XCB_LIBRARIES = {
    "libxcb.so.1": "libxcb1", "libX11-xcb.so.1": "libx11-xcb1", "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4", "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1", "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render-util.so.0": "libxcb-render-util0", "libxcb-render.so.0": "libxcb-render0",
    "libxcb-shape.so.0": "libxcb-shape0", "libxcb-shm.so.0": "libxcb-shm0", "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1", "libxcb-xfixes.so.0": "libxcb-xfixes0", "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0", "libxkbcommon.so.0": "libxkbcommon0",
    "libfontconfig.so.1": "libfontconfig1", "libdbus-1.so.3": "libdbus-1-3", "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
}
SCREENSHOT_MAKER = "AC Studio"
SCREENSHOT = png_kind("screenshot", maker=SCREENSHOT_MAKER)
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


def uses_xcb() -> bool:
    """Will Qt pick its X11 (xcb) platform plugin? Only then are the X libraries needed."""
    platform = os.environ.get("QT_QPA_PLATFORM", "")
    if platform:
        return platform.split(":")[0] == "xcb"
    return bool(os.environ.get("DISPLAY")) and not os.environ.get("WAYLAND_DISPLAY")


def missing_xcb_packages(libraries: dict[str, str] = XCB_LIBRARIES) -> list[str]:
    """Debian packages of the libraries Qt's xcb plugin needs that cannot be loaded here."""
    missing = []
    for soname, package in libraries.items():
        try:
            ctypes.CDLL(soname)
        except OSError:
            missing.append(package)
    return missing


def qt_platforms() -> set[str]:
    """The platform plugins this Qt has (``xcb``, ``wayland``, ``offscreen``, ...), found without starting Qt."""
    from PySide6.QtCore import QLibraryInfo

    folder = Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath)) / "platforms"
    names = {p.name.split(".")[0].removeprefix("lib").removeprefix("q") for p in folder.glob("*q*")} \
        if folder.is_dir() else set()
    if any(n.startswith("wayland") for n in names):
        names.add("wayland")
    return names


def display_problem() -> str:
    """Why Qt could not open a window here ("" if it can): Qt would abort the process with many lines instead."""
    requested = [p.split(":")[0] for p in os.environ.get("QT_QPA_PLATFORM", "").split(";") if p.strip()]
    available = qt_platforms()
    if requested and available and not any(p in available for p in requested):
        return (f"QT_QPA_PLATFORM={os.environ['QT_QPA_PLATFORM']} names no Qt platform plugin here — use one of "
                f"{', '.join(sorted(available))}, or unset it")
    if sys.platform != "linux":
        return ""
    display, wayland = os.environ.get("DISPLAY"), os.environ.get("WAYLAND_DISPLAY")
    first = requested[0] if requested else ("wayland" if wayland else "xcb")
    if first == "xcb" and not display:
        return ("no X display: DISPLAY is not set — run it in a desktop session (or ssh -X), or render a PNG "
                "with acstudio --screenshot OUT.png")
    if first.startswith("wayland") and not wayland:
        return "no Wayland display: WAYLAND_DISPLAY is not set — run it in a desktop session, or unset QT_QPA_PLATFORM"
    return ""


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
    try:
        if shot is not None:
            check_output(shot, SCREENSHOT)
    except ACStudioError as exc:
        print(f"acstudio: error: --screenshot: {exc}", file=sys.stderr)
        return 2
    problem = display_problem()
    if problem:
        print(f"acstudio: error: the window cannot open: {problem}", file=sys.stderr)
        return 2
    missing = missing_xcb_packages() if uses_xcb() else []
    if missing:
        print(f"acstudio: error: the window cannot open: Qt's X11 plugin needs libraries that are not installed — "
              f"install them with: apt-get install {' '.join(missing)}", file=sys.stderr)
        return 2

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
        image = window.grab().toImage()
        image.setText("Software", SCREENSHOT_MAKER)  # so that a later screenshot knows the file as its own
        ok = image.save(out)
        window.close()
    if ok:
        print(out)
    return 0 if ok else 1
