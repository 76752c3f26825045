"""The studio's view logic without Qt: graph grouping and layout, the tables and timelines the views draw."""
