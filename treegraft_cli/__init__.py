"""treegraft: benchmark and tune tree-based speculative decoding.

Words used everywhere in this package (DESIGN.md §2). They are defined here once.

target
    The model being accelerated. Its output distribution is preserved exactly.
drafter
    Anything that proposes tokens: ``model`` (a small LM with its own KV cache), ``ngram`` (matches
    the committed context), ``adjacency`` (retrieval table of top-k successors).
pair
    ``DRAFTER:TARGET``, the strong drafter and the target, e.g. ``qwen2.5-coder-0.5b:qwen2.5-coder-1.5b``.
root
    The last committed token. It is not yet in the target's KV cache; every draft tree hangs from it
    and the verification forward starts with it. Node index 0 of every tree is the root.
node
    One candidate token in the tree: token id, parent index, depth, score, origin (which drafter).
score
    Cumulative log-probability of the path root→node under the drafter that last scored it.
budget
    ``N``: the number of non-root nodes sent to one target verification forward.
step
    One draft → verify → commit round.
accepted length
    ``τ``: tokens committed in one step = accepted draft nodes + 1 bonus token.
bonus
    The token the target itself chooses after the deepest accepted node (argmax at T=0, a sample from
    the residual distribution at T>0). It becomes the next root.
commit
    Keep the accepted path's KV rows (moved into contiguous cache positions), drop the rest.
"""

__version__ = "0.1.0"
