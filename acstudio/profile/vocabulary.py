"""The words a profile's rows use for where a node runs and what a storage holds.

Both the data model and the file schema need them, so they live below both.
"""

# Node regions in iteration order; "input" are placeholders, "output" the graph's output node.
REGIONS = ("input", "forward", "loss", "backward", "optimizer", "output")
# Storage categories (what the memory timeline stacks).
CATEGORIES = ("parameter", "buffer", "gradient", "optimizer_state", "input", "activation", "temporary")
