"""The studio's logic without Qt: graph grouping and layout, what the tables, timeline and Pareto chart show, and
the protocol of the child processes that profile, probe and sweep for the window."""
