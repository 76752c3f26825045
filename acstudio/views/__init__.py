"""The studio's logic without Qt: the session the window binds to, the documents it opens, graph grouping and
layout, what the tables, timeline and Pareto chart show, and the protocol of the child processes that profile,
probe and sweep for the window."""
