"""DraftTree: the candidate tokens of one step, held as tensors.

Node 0 is the root (the last committed token). Nodes are stored parents-before-children, siblings
have distinct tokens, and every tree builder grows the tree in batches of children so no per-node
Python runs on the hot path.
"""

from __future__ import annotations

import array
import struct

import torch

from .hostlists import floats, longs
from .syncs import host_only, read
from .verify import tree_buffers

# Which drafter proposed a node (the ``origin`` column).
ORIGIN_ROOT = 0
ORIGIN_MODEL = 1
ORIGIN_NGRAM = 2
ORIGIN_ADJACENCY = 3
ORIGIN_NAMES = {ORIGIN_ROOT: "root", ORIGIN_MODEL: "model", ORIGIN_NGRAM: "ngram", ORIGIN_ADJACENCY: "adjacency"}


COLUMNS = ("tokens", "parents", "depths", "scores", "origins", "kv_slot")
_FILL = (0, -1, 0, float("-inf"), ORIGIN_ROOT, -1)
INITIAL_CAPACITY = 64
_LONG_COLUMNS = ("tokens", "parents", "depths", "kv_slot")
_STRUCTURE = ("tokens", "parents", "depths")  # columns that change only when nodes are written


class DraftTree:
    """A draft tree. Every column is a 1-D tensor of length ``num_nodes`` (root included).

    ``kv_slot`` is the cache position of the node's row in the model drafter's KV cache, or -1 when the
    model drafter never ran a forward over the node; it lets the drafter commit its own cache.

    The columns are views of preallocated buffers that grow by doubling, and the ancestor mask is kept
    row by row as nodes are appended (a node's row is its parent's plus itself), so growing the tree
    allocates nothing and ``ancestor_mask()`` costs nothing. ``num_nodes`` is a host integer: appending
    children whose count is known (``append_children``) needs no synchronisation; merging duplicates
    (``add_children``) reads one number, how many nodes are new.

    A *host* tree (``host=True``) is built on the host by a host-side drafter (n-gram, retrieval) and
    uploaded for verification: its reads are host work, not synchronisations.
    """

    def __init__(
        self,
        tokens: torch.Tensor,  # [num_nodes] int64
        parents: torch.Tensor,  # [num_nodes] int64, -1 for the root
        depths: torch.Tensor,  # [num_nodes] int64, 0 for the root
        scores: torch.Tensor,  # [num_nodes] float32, cumulative log-prob; 0 for the root
        origins: torch.Tensor,  # [num_nodes] int8
        kv_slot: torch.Tensor,  # [num_nodes] int64
        ancestor_mask: torch.Tensor | None = None,  # [num_nodes, num_nodes] bool; built from parents when absent
        host: bool = False,
    ):
        n = tokens.shape[0]
        if ancestor_mask is None:
            ancestor_mask = _ancestor_mask(parents, depths, n)
        columns = (tokens.long(), parents.long(), depths.long(), scores.float(), origins.to(torch.int8), kv_slot.long())
        self._adopt(dict(zip(COLUMNS, columns, strict=True)), ancestor_mask, n, host)

    def _adopt(self, buffers: dict[str, torch.Tensor], mask: torch.Tensor, n: int, host: bool,
               longs: torch.Tensor | None = None) -> None:
        """Take ``buffers`` (columns of ``capacity`` entries, the first ``n`` in use) and ``mask`` as they are.

        ``longs``: ``[4, capacity]`` when the int64 columns are its rows (``_LONG_COLUMNS`` order): one op then
        writes, copies or selects them all."""
        self.host = host
        self._device = mask.device
        self._buffers, self._mask, self._longs = buffers, mask, longs
        self._capacity = mask.shape[0]
        self._n = n
        self._key_index: dict[tuple[int, int], int] = {}  # host trees: (parent, token) → node, for merging
        self._indexed = 0  # nodes already in _key_index
        self._refresh()

    @classmethod
    def from_root(cls, root_token: int | torch.Tensor, device: torch.device | str = "cpu", capacity: int = 0,
                  host: bool = False, parts: tuple[torch.Tensor, ...] | None = None) -> DraftTree:
        """A tree holding the root only; ``root_token`` may be a one-element tensor (no read). ``parts``: fresh
        buffers of a root-only tree of this capacity (``RootTrees``), else they are allocated here."""
        device = device if isinstance(device, torch.device) else torch.device(device)
        tree = cls.from_parts(parts if parts is not None else _fresh(device, capacity or INITIAL_CAPACITY), 1, host)
        tokens = tree.buffer("tokens")
        if isinstance(root_token, torch.Tensor):
            tokens[:1] = root_token.reshape(1)
        else:
            tokens[0].fill_(int(root_token))
            if host:  # the structure lists are known: no read of the buffers for them
                tree._views.update({("list", "tokens"): [int(root_token)], ("list", "parents"): [-1],
                                    ("list", "depths"): [0]})
                tree._indexed = 1  # the root's key is never looked up: every request names a parent ≥ 0
        return tree

    @classmethod
    def from_root_children(cls, parts: tuple[torch.Tensor, ...], root_token: int, tokens: list[int],
                           scores: list[float]) -> DraftTree:
        """The host tree ``add_root_children`` makes of a root-only tree, on ``parts``: buffers of a root and
        ``len(tokens)`` children whose parents, depths, origins and ancestor mask are written already (``RootTrees``).
        Writes the tokens (``tokens`` distinct) and the children's ``scores`` (float32 values)."""
        k = len(tokens)
        parts[0][0, : 1 + k] = longs([root_token, *tokens])  # the tokens row of the int64 block
        parts[1][1 : 1 + k] = floats(scores)
        tree = cls.from_parts(parts, 1 + k, host=True)
        tree._views.update({("list", "tokens"): [root_token, *tokens], ("list", "parents"): [-1] + [0] * k,
                            ("list", "depths"): [0] + [1] * k, ("list", "scores"): float32_list([0.0, *scores])})
        tree._key_index = {(0, token): node for node, token in enumerate(tokens, start=1)}
        tree._indexed = 1 + k
        return tree

    def parts(self) -> tuple[torch.Tensor, ...]:
        """The tree's whole buffers: int64 columns ``[4, capacity]``, scores, origins, ancestor mask (``from_parts``):
        what reading the tree to the host takes, for one ``fetch`` together with other tensors."""
        if self._longs is None:
            raise ValueError("only a tree grown from a root (from_root, RootTrees) keeps its int64 columns in one block")
        return self._longs, self._buffers["scores"], self._buffers["origins"], self._mask

    @classmethod
    def from_parts(cls, parts: tuple[torch.Tensor, ...], num_nodes: int, host: bool = False) -> DraftTree:
        """A tree of ``num_nodes`` nodes on ``parts`` (``DraftTree.parts``, e.g. their host copies), taken as they are."""
        tree = cls.__new__(cls)
        buffers, mask = _columns(parts)
        tree._adopt(buffers, mask, num_nodes, host, parts[0])
        return tree

    @classmethod
    def from_read_parts(cls, parts: tuple[torch.Tensor, ...], num_nodes: int) -> DraftTree:
        """A host tree on ``parts`` just read from the device (``parts()``' host copies), its structure and scores kept
        as the lists the layer loop reads at every layer, from one conversion of the int64 block and one of the
        scores."""
        tree = cls.from_parts(parts, num_nodes, host=True)
        with host_only():
            columns, scores = parts[0].tolist()[: len(_STRUCTURE)], parts[1].tolist()[:num_nodes]
        tree._views.update({("list", name): column[:num_nodes] for name, column in zip(_STRUCTURE, columns, strict=True)})
        tree._views[("list", "scores")] = scores
        return tree

    def _reserve(self, extra: int) -> None:
        """Room for ``extra`` more nodes: double the buffers until they fit (copying what is there)."""
        needed = self._n + extra
        if needed <= self._capacity:
            return
        capacity = max(self._capacity, 1)
        while capacity < needed:
            capacity *= 2
        n = self._n
        parts = _fresh(self._device, capacity)  # fill values everywhere past the copied rows
        buffers, mask = _columns(parts)
        if self._longs is not None:
            parts[0][:, :n] = self._longs[:, :n]
        else:
            for name in _LONG_COLUMNS:
                buffers[name][:n] = self._buffers[name][:n]
        for name in ("scores", "origins"):
            buffers[name][:n] = self._buffers[name][:n]
        mask[:n, :n] = self._mask[:n, :n]
        index, indexed = self._key_index, self._indexed  # node indices do not change when the buffers grow
        self._adopt(buffers, mask, n, self.host, parts[0])
        self._key_index, self._indexed = index, indexed

    def _refresh(self) -> None:
        """Forget the column views: each is sliced again when first used (most steps use a few columns)."""
        self._views: dict[str, torch.Tensor] = {}

    def _column(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            buffer = self._buffers[name]
            view = self._views[name] = buffer if self._n == self._capacity else buffer[: self._n]
        return view

    # columns: views of the buffers; assigning writes into them
    def _set_structure(self, name: str, value: torch.Tensor) -> None:
        self._column(name).copy_(value)
        self._views.pop(("list", name), None)

    tokens = property(lambda self: self._column("tokens"), lambda self, v: self._set_structure("tokens", v))
    parents = property(lambda self: self._column("parents"), lambda self, v: self._set_structure("parents", v))
    depths = property(lambda self: self._column("depths"), lambda self, v: self._set_structure("depths", v))
    scores = property(lambda self: self._column("scores"), lambda self, v: self._set_scores(v))
    origins = property(lambda self: self._column("origins"), lambda self, v: self._column("origins").copy_(v))
    kv_slot = property(lambda self: self._column("kv_slot"), lambda self, v: self._column("kv_slot").copy_(v))

    def _set_scores(self, value: torch.Tensor) -> None:
        self._column("scores").copy_(value)
        self._views.pop(("list", "scores"), None)

    def buffer(self, name: str) -> torch.Tensor:
        """Column ``name``'s whole buffer, ``capacity`` entries, fill values past the nodes: what indexing by node
        needs, without slicing a view of the first ``num_nodes`` after every write (a tree only grows: the
        entries past its nodes are the fill values until nodes are written there)."""
        return self._buffers[name]

    def ancestor_rows(self, nodes: torch.Tensor) -> torch.Tensor:  # nodes: [m] -> [m, capacity] bool
        """The ancestor-mask rows of ``nodes`` over the whole buffer (no ancestor past the nodes)."""
        return self._mask.index_select(0, nodes)

    def listed(self, name: str) -> list[int]:
        """A host tree's ``tokens``, ``parents`` or ``depths`` as a Python list, kept until nodes are written
        (those columns change only then): the layer loop reads them at every layer."""
        value = self._views.get(("list", name))
        if value is None:
            if name not in _STRUCTURE or not self.host:
                raise ValueError(f"only a host tree's {', '.join(_STRUCTURE)} are kept as lists, not {name!r}")
            value = self._views[("list", name)] = self.host_list(name)
        return value

    def score_list(self) -> list[float]:
        """A host tree's scores as a Python list (not to be changed): the list its host-side writers left
        (``add_rescored_children``, ``add_chains``, ``from_root_children``), else read fresh."""
        value = self._views.get(("list", "scores"))
        return self.host_list("scores") if value is None else value

    def host_list(self, name: str) -> list:
        """A host tree's column as a Python list, read fresh (one conversion of the whole buffer, no slice)."""
        with host_only():
            return self._buffers[name].tolist()[: self._n]

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return self._n

    @property
    def size(self) -> int:
        """Non-root nodes: what counts against the budget."""
        return self._n - 1

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_depth(self) -> int:
        return int(self._read(self.depths.max()))

    def _read(self, tensor: torch.Tensor):
        """A value this tree's code needs on the host: a counted read on a device tree, host work on a host tree."""
        if self.host:
            with host_only():
                return tensor.tolist()
        return read(tensor)

    def ancestor_mask(self) -> torch.Tensor:
        """[num_nodes, num_nodes] bool: ``mask[i, j]`` iff j is i or an ancestor of i (a view: do not mutate)."""
        view = self._views.get("mask")
        if view is None:
            n = self._n
            view = self._views["mask"] = self._mask if n == self._capacity else self._mask[:n, :n]
        return view

    def append_children(
        self,
        parents: torch.Tensor,  # [m] node indices
        tokens: torch.Tensor,  # [m]
        scores: torch.Tensor,  # [m]
        origin: int,
    ) -> torch.Tensor:
        """Append children known to be new (no (parent, token) pair repeats or exists): no read. Returns their indices [m]."""
        n = self.append(parents, tokens, scores, origin)
        return torch.arange(n, self._n, device=self._device)

    def append(
        self,
        parents: torch.Tensor,  # [m] node indices
        tokens: torch.Tensor,  # [m]
        scores: torch.Tensor,  # [m]
        origin: int,
        depth: int | None = None,  # every new node's depth, when the caller knows it (spares looking it up)
    ) -> int:
        """``append_children`` returning the first new index (the new nodes are ``first .. num_nodes - 1``)."""
        self._reserve(parents.shape[0])
        n = self._n
        self._write(n, _as(parents, torch.long), _as(tokens, torch.long), _as(scores, torch.float32), origin, depth=depth)
        return n

    def _write(
        self,
        n: int,
        parents: torch.Tensor,  # [m] node indices; with ``generations``, also nodes of this batch (n + j)
        tokens: torch.Tensor,  # [m]
        scores: torch.Tensor,  # [m]
        origin: int,
        generations: int = 0,  # longest chain of parents inside the batch (0: every parent already exists)
        depth: int | torch.Tensor | None = None,  # the new nodes' depth(s), when known ([m] with ``inside``)
        inside: torch.Tensor | None = None,  # [m, m] uint8, the batch's own ancestry (self included), when known
    ) -> None:
        """Write ``m`` nodes at ``n``: columns, ancestor-mask rows and depths (a row's count of ancestors).

        Rows past ``n`` were never written (trees only grow): kv_slot keeps its -1 fill and each mask row
        its diagonal, so children of existing nodes take their parents' rows or-ed in. A caller that knows which
        new nodes are ancestors of which (``inside``: a graft's template, the batch parents first) gives each row
        at once: its nearest existing ancestor's row (the parent of its shallowest new ancestor), then the batch's.
        """
        m = parents.shape[0]
        b = self._buffers
        if inside is not None:
            anchors = parents.index_select(0, inside.argmax(dim=1))  # argmax: the first 1, the shallowest ancestor
            rows = self._mask.index_select(0, anchors)  # [m, capacity]: nothing at or past ``n`` (existing nodes)
            rows[:, n : n + m] = inside
            self._mask[n : n + m] = rows
            depths = depth
        elif generations:  # parents inside the batch: pointer doubling pulls in their rows
            # [m, capacity] the parent's row: an existing parent's ancestors, or an unwritten row (an inside parent's),
            # which holds only its own diagonal, the parent itself
            rows = self._mask.index_select(0, parents)
            rows[:, n : n + m].fill_diagonal_(True)
            inside = parents >= n
            up = torch.where(inside, parents - n, torch.arange(m, device=self._device))
            for _ in range(generations.bit_length()):
                rows |= rows.index_select(0, up)
                up = up.index_select(0, up)
            self._mask[n : n + m] = rows
            depths = rows.sum(dim=1) - 1
        else:
            self._mask[n : n + m].bitwise_or_(self._mask.index_select(0, parents))  # not ``|=``: no setitem after
            # a batch of children of existing nodes: one below their parents (cheaper than counting ancestors)
            depths = depth if depth is not None else b["depths"].index_select(0, parents) + 1
        if self._longs is not None:
            if isinstance(depths, int):
                self._longs[:2, n : n + m] = torch.stack([tokens, parents])
                self._longs[2, n : n + m] = depths
            else:
                self._longs[:3, n : n + m] = torch.stack([tokens, parents, depths])
        else:
            b["tokens"][n : n + m] = tokens
            b["parents"][n : n + m] = parents
            b["depths"][n : n + m] = depths
        b["scores"][n : n + m] = scores
        b["origins"][n : n + m] = origin
        self._n = n + m
        self._refresh()

    def _write_lists(self, n: int, parents: list[int], tokens: list[int], origin: int) -> None:
        """``_write`` for a host tree from host lists (scores are the caller's to write): depths and ancestors
        inside the batch are worked out in Python, so a batch of chains needs no pointer doubling. The tree's
        cached structure lists are extended, not dropped."""
        m, capacity = len(parents), self._capacity
        depths = self.listed("depths")
        new_depths, anchors, marks = [], [], []  # anchors: nearest ancestor already in the tree
        for j, parent in enumerate(parents):
            new_depths.append((depths[parent] if parent < n else new_depths[parent - n]) + 1)
            while parent >= n:  # ancestors in this batch (parents come first)
                marks.append(j * capacity + parent)
                parent = parents[parent - n]
            anchors.append(parent)
        lists = {name: self.listed(name) for name in _STRUCTURE}
        columns = longs(tokens + parents + new_depths + anchors + marks)  # one host tensor, sliced
        if marks:  # the anchors' rows, the batch's own ancestors marked
            rows = self._mask.index_select(0, columns[3 * m : 4 * m])  # [m, capacity]
            rows.view(-1).index_fill_(0, columns[4 * m :], True)
            self._mask[n : n + m].bitwise_or_(rows)
        else:  # children of existing nodes: each unwritten row holds its diagonal, or-ed with the parent's row
            self._mask[n : n + m].bitwise_or_(self._mask.index_select(0, columns[m : 2 * m]))
        b = self._buffers
        if self._longs is not None:
            self._longs[:3, n : n + m] = columns[: 3 * m].view(3, m)
        else:
            b["tokens"][n : n + m] = columns[:m]
            b["parents"][n : n + m] = columns[m : 2 * m]
            b["depths"][n : n + m] = columns[2 * m : 3 * m]
        b["origins"][n : n + m] = origin
        self._n = n + m
        self._refresh()
        for name, column in (("tokens", tokens), ("parents", parents), ("depths", new_depths)):
            self._views[("list", name)] = lists[name] + column

    def add_children(
        self,
        parents: torch.Tensor,  # [m] node indices
        tokens: torch.Tensor,  # [m]
        scores: torch.Tensor,  # [m]
        origin: int,
        rescore: bool = False,
    ) -> torch.Tensor:
        """Append children; a (parent, token) pair that already exists or repeats is not added.

        Returns the node index of every requested child ([m]): new nodes get new indices, duplicates
        get the index of the node they merged into. A merged node keeps the higher of its two scores,
        or with ``rescore`` takes the new score (the strong drafter's word replaces the weak one's).
        One read: the number of new nodes.
        """
        parents, tokens, scores = _as(parents, torch.long), _as(tokens, torch.long), _as(scores, torch.float32)
        m, n = parents.shape[0], self._n
        if m == 0:
            return parents
        if self.host:
            return self._add_children_on_host(parents, tokens, scores, origin, rescore)
        keys = _keys(parents, tokens)  # [m]
        same_existing = keys[:, None] == _keys(self.parents, self.tokens)[None, :]  # [m, n]
        in_tree = same_existing.any(dim=1)
        first = (keys[:, None] == keys[None, :]).byte().argmax(dim=1)  # first request with the same key
        requests = torch.arange(m, device=self._device)
        is_new = ~in_tree & (first == requests)
        rank = torch.cumsum(is_new, 0) - 1  # position among the new nodes, in request order
        node = torch.where(in_tree, same_existing.byte().argmax(dim=1), n + rank[first])
        count = int(self._read(is_new.sum()))
        if count:
            self._reserve(count)
            new = torch.sort((~is_new).byte(), stable=True).indices[:count]  # the new requests, in request order
            self._write(n, parents[new], tokens[new], scores[new], origin)
        if rescore:  # touched nodes forget their old score and take the (best) new one
            self.scores[node] = float("-inf")
        self.scores.scatter_reduce_(0, node, scores, reduce="amax")
        self._views.pop(("list", "scores"), None)
        return node

    def to(self, device: torch.device | str) -> DraftTree:
        """This tree on ``device`` (itself when already there); a host tree's upload for verification."""
        device = device if isinstance(device, torch.device) else torch.device(device)
        if device == self._device:
            return self
        copies = {name: getattr(self, name).to(device, non_blocking=True) for name in COLUMNS}
        tree = DraftTree.__new__(DraftTree)
        tree._adopt(copies, self.ancestor_mask().to(device, non_blocking=True), self._n, host=device.type == "cpu")
        return tree

    def _add_children_on_host(
        self, parents: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, origin: int, rescore: bool
    ) -> torch.Tensor:
        """``add_children`` for a host tree: a Python index of (parent, token) pairs does the merging (a few
        dozen requests cost less in Python than in tensor ops)."""
        with host_only():
            index = self._indexed_keys()
            n, new, node = self._n, [], []
            for i, key in enumerate(zip(parents.tolist(), tokens.tolist(), strict=True)):
                j = index.get(key)
                if j is None:
                    j = index[key] = n + len(new)
                    new.append(i)
                node.append(j)
            if new:
                self._reserve(len(new))
                first = longs(new)
                self._write(n, parents[first], tokens[first], scores[first], origin)
                self._indexed = self._n  # the new keys are in the index already
            node = longs(node)
            if rescore:  # touched nodes forget their old score and take the (best) new one
                self.scores[node] = float("-inf")
            self.scores.scatter_reduce_(0, node, scores, reduce="amax")
            self._views.pop(("list", "scores"), None)
            return node

    def add_rescored_children(
        self,
        parents: list[int],  # [m] node indices
        tokens: list[int],  # [m]
        scores: list[float],  # [m] float32 values
        origin: int,
        node_scores: list[float],  # [num_nodes] float32 values: every node's score before the merge
    ) -> tuple[list[int], list[float]]:
        """``add_children(..., rescore=True)`` on a host tree, from host lists, after setting every node's score
        to ``node_scores``: the scores are settled in Python and written as one column (a strong call's merge
        touches a few dozen nodes, cheaper in Python than in per-step tensor ops). Returns each request's node
        and every node's score after the merge.
        """
        with host_only():
            index = self._indexed_keys()
            n, keys = self._n, list(zip(parents, tokens, strict=True))
            if index.keys().isdisjoint(keys) and len(set(keys)) == len(keys):  # all new (a tree without chains)
                nodes = list(range(n, n + len(keys)))
                index.update(zip(keys, nodes, strict=True))
                return nodes, self._append_scored(n, parents, tokens, origin, [*node_scores, *scores])
            final = list(node_scores)
            new_parents, new_tokens, nodes = [], [], []
            best: dict[int, float] = {}  # touched node → the best score offered to it
            for key, score in zip(keys, scores, strict=True):
                node = index.get(key)
                if node is None:  # a new node, numbered in request order
                    node = index[key] = n + len(new_parents)
                    new_parents.append(key[0])
                    new_tokens.append(key[1])
                    final.append(score)
                nodes.append(node)
                best[node] = max(best.get(node, float("-inf")), score)
            for node, score in best.items():
                final[node] = score
            return nodes, self._append_scored(n, new_parents, new_tokens, origin, final)

    def _append_scored(self, n: int, parents: list[int], tokens: list[int], origin: int, scores: list[float]) -> list[float]:
        """Write new nodes (``parents`` and ``tokens``, already in the key index) at ``n`` and every node's ``scores``
        (one column write); returns ``scores``."""
        if parents:
            self._reserve(len(parents))
            self._write_lists(n, parents, tokens, origin)
            self._indexed = self._n  # the index holds the new keys already
        self._buffers["scores"][: self._n] = floats(scores)  # every node's settled score in one write
        self._views[("list", "scores")] = scores
        return scores

    def add_root_children(self, tokens: list[int], scores: list[float], origin: int) -> None:
        """Children of the root on a host tree holding the root alone: ``tokens`` distinct (a top-K), ``scores`` their
        float32 scores. ``add_rescored_children`` of a root-only tree, without its merge: every child is new, at depth
        1, and its ancestor row is the root's column and its own diagonal (already set)."""
        if not self.host or self._n != 1:
            raise ValueError(f"add_root_children needs a host tree holding the root alone, not {self._n} nodes")
        k = len(tokens)
        if not k:
            return
        self._reserve(k)
        end = 1 + k
        columns = longs([*tokens, *([0] * k), *([1] * k)])  # tokens, parents, depths
        if self._longs is not None:
            self._longs[:3, 1:end] = columns.view(3, k)
        else:
            for i, name in enumerate(_STRUCTURE):
                self._buffers[name][1:end] = columns[i * k : (i + 1) * k]
        self._mask[1:end, 0] = True
        self._buffers["origins"][1:end] = origin
        self._buffers["scores"][1:end] = floats(scores)
        lists, index = {name: self.listed(name) for name in _STRUCTURE}, self._indexed_keys()
        self._n = end
        self._refresh()
        for name, column in (("tokens", tokens), ("parents", [0] * k), ("depths", [1] * k)):
            self._views[("list", name)] = lists[name] + column
        index.update(((0, token), node) for node, token in enumerate(tokens, start=1))
        self._indexed = end

    def add_chains(
        self,
        parents: torch.Tensor,  # [c] node each chain hangs under
        tokens: torch.Tensor,  # [c, width] chain tokens
        step_scores: torch.Tensor,  # [c, width] float32 each token's own log-prob; -inf ends a chain
        origin: int,
    ) -> list[int]:
        """Hang chains on a host tree; returns each chain's first node.

        Exactly the tree one ``add_children`` per chain level gives (a token whose (parent, token) pair exists,
        or was added earlier, merges into that node; every node keeps the best score offered to it, a level's
        scores computed before the level's merges), done in Python over a key index: a few hundred tokens
        cost less than per-level tensor ops. Scores are float32 sums: a double-precision sum of two float32
        values rounded to float32 is the float32 sum.
        """
        with host_only():
            index = self._indexed_keys()
            scores = list(self.score_list())
            n, start = self._n, self._n
            current = parents.tolist()
            chains, steps = tokens.tolist(), step_scores.tolist()
            new_parents, new_tokens = [], []
            touched: set[int] = set()
            heads: list[int] = []
            for level in range(tokens.shape[1]):
                active = [c for c, row in enumerate(steps) if row[level] != float("-inf")]
                offered = [float32(scores[current[c]] + steps[c][level]) for c in active]
                for c, score in zip(active, offered, strict=True):
                    key = (current[c], chains[c][level])
                    node = index.get(key)
                    if node is None:  # a new node, numbered in request order, level by level
                        node = index[key] = n
                        n += 1
                        new_parents.append(key[0])
                        new_tokens.append(key[1])
                        scores.append(score)
                    scores[node] = max(scores[node], score)
                    touched.add(node)
                    current[c] = node
                if level == 0:
                    heads = list(current)
            if new_parents:
                self._reserve(n - start)
                self._write_lists(start, new_parents, new_tokens, origin)
                self._indexed = n  # the index holds the new keys already
            if new_parents or touched:
                self._buffers["scores"][:n] = floats(scores)  # new nodes' and merged nodes' scores in one write
                self._views[("list", "scores")] = scores
            return heads

    def _indexed_keys(self) -> dict[tuple[int, int], int]:
        """The (parent, token) → node index of a host tree, extended to the nodes written since."""
        if self._indexed < self._n:
            pairs = zip(self.parents[self._indexed :].tolist(), self.tokens[self._indexed :].tolist(), strict=True)
            for j, key in enumerate(pairs, start=self._indexed):
                self._key_index[key] = j
            self._indexed = self._n
        return self._key_index

    def children_of(self, node: int) -> torch.Tensor:
        return torch.nonzero(self.parents == node).flatten()

    def keep(self, keep: torch.Tensor, count: int | None = None) -> DraftTree:
        """A new tree with the nodes where ``keep`` ([num_nodes] bool) is set; must be prefix-closed.

        ``count``: how many are set (root included), when the caller knows; else it is read.
        """
        keep = keep.clone()
        keep[0].fill_(True)
        if count is None:
            count = int(self._read(keep.sum()))
        kept = torch.sort((~keep).byte(), stable=True).indices[:count]  # kept node indices, ascending
        return self.select(kept)

    def select(self, kept: torch.Tensor) -> DraftTree:
        """A new tree of the nodes ``kept`` ([k] ascending, root first, prefix-closed); no read.

        Its columns are exactly ``k`` long (appending to it reallocates).
        """
        k = kept.shape[0]
        longs = self._longs.index_select(1, kept) if self._longs is not None else None
        if longs is not None:
            buffers = dict(zip(_LONG_COLUMNS, longs.unbind(0), strict=True))
            buffers.update((name, self._buffers[name].index_select(0, kept)) for name in ("scores", "origins"))
        else:
            buffers = {name: getattr(self, name).index_select(0, kept) for name in COLUMNS}
        reindex_parents(kept, buffers["parents"])  # in place: it may be a row of ``longs``
        tree = DraftTree.__new__(DraftTree)
        tree._adopt(buffers, self.ancestor_mask().index_select(0, kept).index_select(1, kept), k, self.host, longs)
        return tree

    def select_nodes(self, kept: list[int]) -> DraftTree:
        """``select`` from host node indices (ascending, root first, prefix-closed): a host tree's structure lists
        follow in Python, so the selected tree's first ``listed`` reads nothing."""
        tree = self.select(longs(kept))
        if self.host:
            tokens, parents, depths = (self.listed(name) for name in _STRUCTURE)
            position = {node: j for j, node in enumerate(kept)}
            tree._views.update({("list", "tokens"): [tokens[i] for i in kept],
                                ("list", "parents"): [position.get(parents[i], -1) for i in kept],
                                ("list", "depths"): [depths[i] for i in kept]})
        return tree

    def top_by_score(self, budget: int) -> DraftTree:
        """The ``budget`` best non-root nodes by score, prefix-closed; no read.

        A child's cumulative log-prob never exceeds its parent's, and a stable sort keeps a parent
        (lower index) ahead of an equal-scored child, so the top set is prefix-closed.
        """
        if self.size <= budget:
            return self
        return self.select(best_by_score(self.scores, budget))

    def close_over_ancestors(self, keep: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """Add every ancestor of a kept node; with ``limit``, the result must fit it (checked: one read)."""
        keep = (self.ancestor_mask() & keep[:, None]).any(dim=0)
        keep[0].fill_(True)
        if limit is not None and int(self._read(keep.sum())) - 1 > limit:
            raise ValueError(f"closing over ancestors grew the tree past its budget {limit}")
        return keep

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (root excluded)."""
        path = []
        parents = self.parents.tolist()
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def validate(self, budget: int | None = None) -> None:
        """Raise if an invariant is broken: used by tests and by builders in debug runs."""
        n = self.num_nodes
        if budget is not None and self.size > budget:
            raise AssertionError(f"tree has {self.size} nodes, budget {budget}")
        if int(self.parents[0]) != -1:
            raise AssertionError("node 0 must be the root")
        idx = torch.arange(n, device=self.device)
        if n > 1 and bool((self.parents[1:] >= idx[1:]).any() | (self.parents[1:] < 0).any()):
            raise AssertionError("parents must come before children")
        if n > 1 and bool((self.depths[1:] != self.depths[self.parents[1:]] + 1).any()):
            raise AssertionError("depth must be parent depth + 1")
        keys = _keys(self.parents, self.tokens)
        if torch.unique(keys).numel() != n:
            raise AssertionError("siblings must have distinct tokens")
        if not torch.equal(self.ancestor_mask(), tree_buffers(self.parents[None])[0][0]):
            raise AssertionError("the ancestor mask must mark each node's ancestors and itself, nothing else")


def best_by_score(scores: torch.Tensor, budget: int) -> torch.Tensor:  # scores: [n] root first -> [1 + budget]
    """The root and the ``budget`` best other nodes by score, ascending: ``top_by_score``'s choice (a stable sort
    keeps a parent, the lower index, ahead of an equal-scored child, so the choice is prefix-closed). Scores are
    cumulative log-probs, the root's 0 and no node's above its parent's: one sort of every node puts the root
    first, ahead of any node that ties it."""
    return torch.sort(torch.sort(scores, descending=True, stable=True).indices[: budget + 1]).values


def reindex_parents(kept: torch.Tensor, parents: torch.Tensor) -> None:  # kept: [k] ascending, parents: [k]
    """In place: each kept node's parent index becomes the parent's position in ``kept``; the root's -1 stays -1
    (nothing in ``kept`` is below it)."""
    torch.sub(torch.searchsorted(kept, parents, right=True), 1, out=parents)


def _fresh(device: torch.device, capacity: int) -> tuple[torch.Tensor, ...]:
    """(int64 columns [4, capacity], scores, origins, ancestor mask) of a root-only tree with token 0."""
    longs = torch.empty(len(_LONG_COLUMNS), capacity, dtype=torch.long, device=device)  # the int64 columns: one block
    for column, name in zip(longs, _LONG_COLUMNS, strict=True):
        column.fill_(_FILL[COLUMNS.index(name)])  # fills: a tensor made from a list would be a blocking copy on CUDA
    scores = torch.full((capacity,), float("-inf"), device=device)
    scores[0].fill_(0.0)
    # every node is its own ancestor: rows are written by or-ing the parent's row into the diagonal
    mask = torch.eye(capacity, dtype=torch.bool, device=device)
    return longs, scores, torch.zeros(capacity, dtype=torch.int8, device=device), mask


def _columns(parts: tuple[torch.Tensor, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    longs, scores, origins, mask = parts
    buffers = dict(zip(_LONG_COLUMNS, longs.unbind(0), strict=True))
    buffers["scores"], buffers["origins"] = scores, origins
    return buffers, mask


class RootTrees:
    """Each step's first tree, copied from a prototype built once per device and shape: the root alone
    (``tree``), or the root and its children (``under_root``, a step whose first layer grafts from a lookup made
    ahead). A tree builder starts a tree every step, and four copies cost less than seven allocations and the writes
    of the structure. Each tree builder owns one."""

    def __init__(self) -> None:
        self._prototypes: dict[tuple[torch.device, int], tuple[torch.Tensor, ...]] = {}
        self._under_root: dict[tuple[torch.device, int, int], tuple[torch.Tensor, ...]] = {}

    def tree(self, root_token: int | torch.Tensor, device: torch.device | str = "cpu", capacity: int = 0,
             host: bool = False) -> DraftTree:
        device = device if isinstance(device, torch.device) else torch.device(device)
        capacity = capacity or INITIAL_CAPACITY
        prototype = self._prototypes.get((device, capacity))
        if prototype is None:
            prototype = self._prototypes[(device, capacity)] = _fresh(device, capacity)
        return DraftTree.from_root(root_token, device, capacity, host, tuple(t.clone() for t in prototype))

    def under_root(self, root_token: int, tokens: list[int], scores: list[float], origin: int,
                   device: torch.device) -> DraftTree:
        """A host tree of the root and its children ``tokens`` (distinct; ``scores`` float32), copied from a
        prototype of that shape built once per device, child count and origin: ``add_root_children`` of ``tree``'s
        root-only tree, for the price of the copies and two writes."""
        key = (device, len(tokens), origin)
        prototype = self._under_root.get(key)
        if prototype is None:
            shape = self.tree(0, device, host=True)
            shape.add_root_children(list(range(len(tokens))), [0.0] * len(tokens), origin)
            prototype = self._under_root[key] = shape.parts()
        return DraftTree.from_root_children(tuple(t.clone() for t in prototype), root_token, tokens, scores)


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype``, without a (counted, no-op) conversion call when it is already."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def float32(value: float) -> float:
    """``value`` rounded to the nearest float32 (what a float32 tensor would hold)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def float32_list(values: list[float]) -> list[float]:
    """``float32`` of each of ``values``, converted in one call."""
    return array.array("f", values).tolist()


def _keys(parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # parent index and token packed into one int64 (token ids < 2**32)
    return (parents + 1) * (1 << 32) + tokens


def _ancestor_mask(parents: torch.Tensor, depths: torch.Tensor, n: int) -> torch.Tensor:  # -> [n, n] bool
    """The ancestor relation of parents-first columns, one pass per depth (trees built from columns only)."""
    mask = torch.eye(n, dtype=torch.bool, device=parents.device)
    for depth in range(1, int(depths.max()) + 1 if n else 0):
        rows = torch.nonzero(depths == depth).flatten()
        mask[rows] |= mask[parents[rows]]
    return mask
