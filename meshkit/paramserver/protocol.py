"""The messages between workers and servers: a small float64 header, then a text and a tensor when there are any.

Every receive names its sender (no any-source receive): a receive from a dead peer fails as soon as the
connection closes, which is how a server learns that a worker is gone, and a worker that a server is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER_LEN = 6


class Kind(enum.IntEnum):
    PULL = 0  # the parameters as they are (a worker's start)
    EXCHANGE = 1  # here is my gradient; answer with the parameters once the staleness bound allows
    SAVE = 2  # checkpoint into the directory named by the text (answered once every live worker asked)
    LOAD = 3  # restore from the directory named by the text (likewise)
    DONE = 4  # this worker has finished (no answer)


class Tag(enum.IntEnum):
    REQUEST = 11
    GRADIENT = 12
    REQUEST_TEXT = 13
    REPLY = 21
    PARAMETERS = 22
    REPLY_TEXT = 23


@dataclass
class Request:
    kind: Kind
    clock: int = 0  # the worker's step count: gradients it pushed before this one
    version: int = 0  # the server version the gradient was computed on (its last pull)
    items: float = 1.0  # samples (or tokens) behind the gradient: its weight in the average
    text: str = ""
    gradient: torch.Tensor | None = None


@dataclass
class Reply:
    version: int
    error: str = ""
    commit: bool = False  # SAVE: this worker commits the checkpoint directory once every server answered
    clock: int = 0  # LOAD: the step the checkpoint was taken at
    parameters: torch.Tensor | None = None


def _text_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)


def _recv_text(length: int, src: int, tag: Tag, group: dist.ProcessGroup) -> str:
    if not length:
        return ""
    buffer = torch.empty(length, dtype=torch.uint8)
    dist.recv(buffer, src=src, tag=tag, group=group)
    return bytes(buffer.tolist()).decode()


def send_request(request: Request, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    text = _text_tensor(request.text)
    header = torch.tensor(
        [request.kind, request.clock, request.version, request.items, text.numel(), 0], dtype=torch.float64
    )
    works = [dist.isend(header, dst=dst, tag=Tag.REQUEST, group=group)]
    if text.numel():
        works.append(dist.isend(text, dst=dst, tag=Tag.REQUEST_TEXT, group=group))
    if request.gradient is not None:
        works.append(dist.isend(request.gradient, dst=dst, tag=Tag.GRADIENT, group=group))
    return [w for w in works if w is not None]


def recv_request(
    src: int, numel: int, dtype: torch.dtype, group: dist.ProcessGroup, idle: timedelta | None = None
) -> Request:
    """The next request of worker `src`; `idle`: how long it may take to come (a worker may evaluate or save for
    longer than the collective timeout between two steps; gloo closes every connection when a receive times out)."""
    header = torch.empty(HEADER_LEN, dtype=torch.float64)
    work = dist.irecv(header, src=src, tag=Tag.REQUEST, group=group)
    assert work is not None
    if idle is None:
        work.wait()
    else:
        work.wait(idle)
    kind, clock, version, items, text_len, _ = header.tolist()
    request = Request(Kind(int(kind)), int(clock), int(version), float(items))
    request.text = _recv_text(int(text_len), src, Tag.REQUEST_TEXT, group)
    if request.kind == Kind.EXCHANGE:
        request.gradient = torch.empty(numel, dtype=dtype)
        dist.recv(request.gradient, src=src, tag=Tag.GRADIENT, group=group)
    return request


def send_reply(reply: Reply, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    text = _text_tensor(reply.error)
    has_parameters = reply.parameters is not None
    header = torch.tensor(
        [reply.version, text.numel(), float(reply.commit), reply.clock, float(has_parameters), 0], dtype=torch.float64
    )
    works = [dist.isend(header, dst=dst, tag=Tag.REPLY, group=group)]
    if text.numel():
        works.append(dist.isend(text, dst=dst, tag=Tag.REPLY_TEXT, group=group))
    if reply.parameters is not None:
        works.append(dist.isend(reply.parameters, dst=dst, tag=Tag.PARAMETERS, group=group))
    return [w for w in works if w is not None]


def recv_reply(src: int, numel: int, dtype: torch.dtype, group: dist.ProcessGroup) -> Reply:
    header = torch.empty(HEADER_LEN, dtype=torch.float64)
    dist.recv(header, src=src, tag=Tag.REPLY, group=group)
    version, text_len, commit, clock, has_parameters, _ = header.tolist()
    reply = Reply(int(version), commit=bool(commit), clock=int(clock))
    reply.error = _recv_text(int(text_len), src, Tag.REPLY_TEXT, group)
    if has_parameters:
        reply.parameters = torch.empty(numel, dtype=dtype)
        dist.recv(reply.parameters, src=src, tag=Tag.PARAMETERS, group=group)
    return reply
