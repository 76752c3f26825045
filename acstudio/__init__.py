"""AC Studio: measure a whole PyTorch training step, plan activation checkpointing with mu-TWO, rewrite it."""

__version__ = "0.1.0"


def load_step(directory, model, optimizer):
    """Bind an exported step (``acstudio export``) to ``model`` and ``optimizer``: ``loss = step(batch)``.

    Imported lazily so that ``import acstudio`` stays light; see :func:`acstudio.export.loader.load_step`.
    """
    from acstudio.export.loader import load_step as _load_step

    return _load_step(directory, model, optimizer)


def apply_plan(model, plan, compile_options=None):
    """Wrap ``model``'s blocks in place in selective-checkpointing checkpoints that follow ``plan``; returns it.

    ``plan``: a folder written by ``acstudio export ... --format sac``, or a ``(Profile, Plan)`` pair;
    ``compile_options``: ``torch.compile``'s, for the blocks a plan made for torch.compile runs compiled one by one.
    See :func:`acstudio.export.apply.apply_plan`.
    """
    from acstudio.export.apply import apply_plan as _apply_plan

    return _apply_plan(model, plan, compile_options)
