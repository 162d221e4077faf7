"""The scheduler: continuous batching over module-based steps.

Each `schedule()`:
  1. admit: while fewer than B sequences are in flight, take the next request (preempted
     sequences first) if the KV pool can hold its prompt plus the running sequences'
     expected growth, and the step's prefill budget is not spent; the leading blocks of its
     tokens that an earlier request computed are shared, not computed again (blocks.match).
     A request whose next prompt block a running sequence is computing right now waits (and
     the queue behind it) until that block is cached, then shares it: requests admitted
     together with a common prefix compute it once. A request with n > 1 whose completions
     cannot all be held by the whole pool at once (prompt blocks shared, each completion's
     own up to max_tokens) is rejected alone, before it takes anything (`rejected`), so it
     never thrashes the pool or starves the requests behind it;
  2. plan the step's work: one token for every decoding sequence, and prompt chunks of at
     most the remaining prefill budget for sequences still prefilling (long prompts are
     prefilled over several steps, interleaved with the decode of the others);
  3. reserve the work's KV blocks, in work order, with a copy of each shared block a chunk
     writes into (copy on write); when the pool cannot hold the next one, preempt the most
     recently admitted sequence (free its blocks, recompute it later) and plan again. A
     sequence that does not fit even alone is rejected (`rejected`);
  4. emit the step plan (scheduler/step_plan.py): the worker never reserves anything.
After the worker ran a plan, `advance` marks its chunks cached and registers their full
blocks for sharing, `fork` gives a request with n > 1 its other completions once its prompt
is cached (they share its blocks), and `retire` frees the blocks of a sequence that
finished. A request with n completions holds n batch slots from its admission. Freed slots
are refilled from the queue at the next step, so the batch stays full until the queue drains.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from moecc_runtime.sampling import request_generator
from moecc_runtime.scheduler.blocks import NO_PREFIX, BlockAllocator, KVCacheFull
from moecc_runtime.scheduler.sequence import GenRequest, Sequence
from moecc_runtime.scheduler.step_plan import SeqChunk, StepPlan

DEFAULT_PREFILL_TOKENS = 2048

Work = list[tuple[Sequence, int]]  # (sequence, tokens of it to run) in row order


@dataclass(frozen=True)
class Rejected:
    """A request the whole pool cannot hold: why, as an error and as a message for its record."""

    request: GenRequest
    error: KVCacheFull
    message: str


class RequestQueue:
    """The requests not yet admitted, read lazily from an iterable with one of lookahead:
    a job of a million lines holds only what is in flight, not the file."""

    def __init__(self, requests: Iterable[GenRequest]):
        self._it: Iterator[GenRequest] = iter(requests)
        self._head: list[GenRequest] = []

    def __bool__(self) -> bool:
        if not self._head:
            nxt = next(self._it, None)
            if nxt is not None:
                self._head.append(nxt)
        return bool(self._head)

    def peek(self) -> GenRequest:
        if not self:
            raise IndexError("no request left")
        return self._head[0]

    def popleft(self) -> GenRequest:
        req = self.peek()
        self._head.clear()
        return req


class Scheduler:
    """Admission, KV block ownership and preemption for one run over `requests`."""

    def __init__(self, blocks: BlockAllocator, requests: Iterable[GenRequest], max_batch: int, prefill_tokens: int):
        self.blocks = blocks
        self.limit = max_batch
        self.budget_per_step = prefill_tokens
        self.queue = RequestQueue(requests)
        self.preempted: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.rejected: list[Rejected] = []  # since the caller last emptied it
        self._new: dict[int, list[int]] = {}  # sid -> blocks reserved for the step being planned
        self._copies: dict[int, list[tuple[int, int]]] = {}  # sid -> its copies on write (source, destination)
        self._next_id = 0
        self._prefix_chains: dict[int, list[int]] = {}  # sid -> hash chain of its full prompt blocks (prefilling)

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.preempted or self.running)

    @property
    def in_flight(self) -> bool:
        return bool(self.running or self.preempted)

    def schedule(self, admit_new: bool = True) -> StepPlan | None:
        """needs: nothing. does: admit (only preempted sequences unless `admit_new`), plan the
        work, reserve its blocks, preempting while they do not fit. guarantees: every slot
        the plan addresses is reserved; None when nothing can run (a rejected sequence may
        have been added to `rejected`)."""
        self._admit(admit_new)
        while True:
            work = _plan_work(self.running, self.budget_per_step)
            if not work:
                return None
            short = self._reserve(work)
            if short is None:
                new = [b for blocks in self._new.values() for b in blocks]
                copies = tuple(c for cs in self._copies.values() for c in cs)
                self._new, self._copies = {}, {}
                return emit_step(self.blocks, work, new, copies=copies)
            self._preempt(short)

    def advance(self, plan: StepPlan) -> list[Sequence]:
        """The worker ran `plan`: its chunks are cached. Returns the sequences whose known
        tokens are all cached now (those the worker returned logits for), in row order."""
        by_sid = {s.sid: s for s in self.running}
        for c in plan.seqs:
            s = by_sid[c.sid]
            s.cached += len(c.tokens)
            if c.start >= s.prompt_len:
                continue  # its prompt's blocks were registered when its last prompt chunk ran
            # only prompt blocks become shareable prefixes: a generated block could match only a
            # later prompt holding this very completion, which a batch submitted at once never has;
            # unregistered, it goes back to the free list (reused first) when the sequence ends, so
            # a job touches as few KV pages as its peak use (the 768 decode-heavy job: 6,115 blocks
            # instead of 10,180, each first touch a page fault)
            self.blocks.register(s.sid, s.tokens, min(s.cached, s.prompt_len))
        return [by_sid[c.sid] for c in plan.seqs if c.finishes]

    def fork(self, parent: Sequence, generators: list[torch.Generator]) -> list[Sequence]:
        """needs: `parent` (choice 0 of a request with n > 1) has its prompt cached, nothing
        generated. does: its n - 1 siblings, sharing its blocks, run from now on (the slots
        its admission held). guarantees: returned in choice order, after `parent` in `running`."""
        req = parent.request
        assert req is not None and parent.choice == 0 and not parent.forked and not parent.generated
        parent.forked = True
        kids = []
        for i, gen in enumerate(generators, start=1):
            kid = Sequence(self._next_id, list(parent.tokens), parent.prompt_len, parent.max_new, parent.cached,
                           request=req, generator=gen, choice=i, prompt_logprobs=parent.prompt_logprobs)
            self._next_id += 1
            self.blocks.fork(parent.sid, kid.sid)
            kids.append(kid)
        at = self.running.index(parent) + 1
        self.running[at:at] = kids
        return kids

    def retire(self, seq: Sequence) -> None:
        """`seq` is finished: free its blocks and its slot."""
        self.blocks.release(seq.sid)
        self.running.remove(seq)
        self._prefix_chains.pop(seq.sid, None)

    def _new_sequence(self, req: GenRequest) -> Sequence:
        self._next_id += 1
        return Sequence(self._next_id - 1, list(req.prompt_ids), len(req.prompt_ids), req.max_tokens,
                        request=req, generator=request_generator(req.seed, req.key))

    def _admit(self, admit_new: bool) -> None:
        """Fill free slots while the prefill budget lasts and the pool has room to spare."""
        if not (self.preempted or (self.queue and admit_new)):
            return  # nothing waits (every step once the queue is drained)
        budget = self.budget_per_step - sum(min(s.pending, self.budget_per_step) for s in self.running if s.pending > 1)
        used = sum(s.slots for s in self.running)
        computing = self._computing_prefixes()
        while (self.preempted or (self.queue and admit_new)) and used < self.limit and budget > 0:
            head = self.preempted[0] if self.preempted else None
            req = head.request if head is not None else self.queue.peek()
            assert req is not None, "the scheduler only runs sequences of requests"
            if head is None and self._reject_unholdable(req):
                continue
            tokens = head.tokens if head is not None else req.prompt_ids
            slots = head.slots if head is not None else req.n
            scored = head.scores_prompt if head is not None else req.prompt_logprobs is not None
            hit = NO_PREFIX if scored else self.blocks.probe(tokens)  # a scored prompt runs every row
            chain = [] if scored or not self.blocks.share_prefixes else self._chain(tokens)
            if self.running and len(hit.blocks) < len(chain) and chain[len(hit.blocks)] in computing:
                break  # its next block is being computed by a running sequence: share it next step
            growth = len(self.running) // self.blocks.block_size + 1  # blocks the running ones may take next step
            need = self.blocks.blocks_for(len(tokens) + 1) - len(hit.blocks)
            if self.running and (need + growth > self.blocks.free_blocks or used + slots > self.limit):
                break
            seq = self.preempted.popleft() if self.preempted else self._new_sequence(self.queue.popleft())
            seq.cached = self.blocks.match(seq.sid, hit)
            self.running.append(seq)
            if chain:
                self._prefix_chains[seq.sid] = chain
                computing.update(chain[seq.cached // self.blocks.block_size:])
            used += seq.slots
            budget -= min(seq.pending, budget)

    def _chain(self, tokens: list[int]) -> list[int]:
        """A hash per full block of `tokens` before the last token, each of the block and all
        before it (equal hashes: equal prefixes, but for a collision, which only delays)."""
        bs, h, out = self.blocks.block_size, 0, []
        for i in range((len(tokens) - 1) // bs):
            h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
            out.append(h)
        return out

    def _computing_prefixes(self) -> set[int]:
        """The chain hashes of the prompt blocks running sequences have yet to compute."""
        bs, out = self.blocks.block_size, set()
        for s in self.running:
            chain = self._prefix_chains.get(s.sid)
            if chain is None or s.cached >= len(chain) * bs:
                self._prefix_chains.pop(s.sid, None)
                continue
            out.update(chain[s.cached // bs:])
        return out

    def _reject_unholdable(self, req: GenRequest) -> bool:
        """Reject (and take from the queue) a request with n > 1 whose n completions the whole
        pool cannot hold at once; True when it did. Its prompt's full blocks are shared, each
        completion holds its own blocks from there up to prompt + max_tokens."""
        if req.n <= 1:
            return False
        bs, prompt = self.blocks.block_size, len(req.prompt_ids)
        full = prompt // bs
        own = self.blocks.blocks_for(prompt + req.max_tokens) - full
        need = full + req.n * own
        if need <= self.blocks.num_blocks:
            return False
        self.queue.popleft()
        fits = max(0, (self.blocks.num_blocks - full) // own)
        msg = (f"request {req.key!r} asks for n={req.n} completions of up to {req.max_tokens} tokens: holding them "
               f"at once takes {need} KV blocks of {bs} tokens, but the whole pool has {self.blocks.num_blocks} "
               f"(it holds {fits} such completions at once); lower n to at most {fits} or max_tokens, or compile "
               f"with more --host-mem")
        self.rejected.append(Rejected(req, KVCacheFull(-1, need, self.blocks.free_blocks, self.blocks.num_blocks), msg))
        return True

    def _reserve(self, work: Work) -> KVCacheFull | None:
        """Reserve each chunk's positions in work order; at the first that does not fit, stop
        and say so (what is reserved stays reserved)."""
        for s, n in work:
            if n == 1 and self.blocks.extend_in_place(s.sid, s.cached):
                continue  # a decode position in its own last block: nothing to take or copy
            need = self.blocks.needs(s.sid, s.cached + n, s.cached)
            if need > self.blocks.free_blocks:
                return KVCacheFull(s.sid, need, self.blocks.free_blocks, self.blocks.num_blocks)
            self._copies.setdefault(s.sid, []).extend(self.blocks.writable(s.sid, s.cached))
            self._new.setdefault(s.sid, []).extend(self.blocks.reserve(s.sid, s.cached + n))
        return None

    def _preempt(self, short: KVCacheFull) -> None:
        """Free the most recently admitted sequence: recomputed from its tokens when
        re-admitted, or rejected when it was running alone (it cannot fit the pool)."""
        victim = self.running.pop()
        self.blocks.register(victim.sid, victim.tokens, victim.cached)  # its generated blocks too: its own re-admission matches them
        self.blocks.release(victim.sid)
        self._prefix_chains.pop(victim.sid, None)
        self._new.pop(victim.sid, None)
        self._copies.pop(victim.sid, None)
        if self.running:
            victim.cached = 0
            self.preempted.appendleft(victim)
            return
        req = victim.request
        assert req is not None, "the scheduler only runs sequences of requests"
        msg = (f"request {req.key!r} needs {self.blocks.blocks_for(len(victim.tokens))} KV blocks of "
               f"{self.blocks.block_size} tokens but the whole pool has {self.blocks.num_blocks}; compile with "
               f"more --host-mem or lower its max_tokens")
        self.rejected.append(Rejected(req, short, msg))


def _plan_work(running: list[Sequence], budget: int) -> Work:
    work = []
    for s in running:
        pending = len(s.tokens) - s.cached
        if pending == 1:
            work.append((s, 1))
        elif budget > 0:
            n = min(pending, budget)
            budget -= n
            work.append((s, n))
    return work


def emit_step(blocks: BlockAllocator, work: Work, new_blocks: list[int], all_rows: bool = False,
              copies: tuple[tuple[int, int], ...] = ()) -> StepPlan:
    """needs: `work`'s positions reserved in `blocks` (each writing only blocks of its own),
    `new_blocks` those reserved for it, `copies` the copies on write that made them its own.
    guarantees: the step plan of `work`, its phase "prefill" when most of its rows are."""
    chunks = []
    prefill = total = 0
    for s, n in work:
        c = s.cached
        if not 0 < n <= len(s.tokens) - c:
            raise ValueError(f"sequence {s.sid}: asked to run {n} of {s.pending} pending tokens")
        slot_blocks, slot_offsets = blocks.slots(s.sid, c, n)
        in_prompt = n > 1 or c < s.prompt_len
        chunks.append(SeqChunk(s.sid, s.tokens[c:c + n], c, list(blocks.tables[s.sid]), slot_blocks, slot_offsets,
                               in_prompt, c + n == len(s.tokens), c < s.prompt_len and s.scores_prompt))
        prefill, total = prefill + n * in_prompt, total + n
    return StepPlan(chunks, "prefill" if 2 * prefill > total else "decode", new_blocks, blocks.usage(), all_rows,
                    copies)


def reserve_step(blocks: BlockAllocator, work: Work, all_rows: bool = False) -> StepPlan:
    """The step plan of fixed `work` (scoring text: no admission, no preemption); raises
    KVCacheFull when the pool cannot hold it."""
    new = [b for s, n in work for b in blocks.reserve(s.sid, s.cached + n)]
    return emit_step(blocks, work, new, all_rows)
