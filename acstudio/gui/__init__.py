"""The desktop app (PySide6 + pyqtgraph): views and drives the engine, adds no engine logic of its own."""
