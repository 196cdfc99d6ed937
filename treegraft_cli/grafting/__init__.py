"""TreeGraft's shared tree (DESIGN.md §4): a weak n-gram drafter and a strong model drafter growing one tree.

``tree_ops`` capped scores, grafting positions and the final cut ·
``builder`` the layer loop. When to call the strong drafter, and the
method's settings (``scheduling.options``), are ``scheduling``'s, which never imports this package.
"""
