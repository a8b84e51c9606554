"""A worker's side: push gradients to every server, pull the parameters back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from meshkit.paramserver.layout import Shard
from meshkit.paramserver.protocol import Kind, Reply, Request, recv_reply, send_request
from meshkit.paramserver.roles import ParameterServerError


class ParameterClient:
    """Talks to every server for this worker's copy of the trainable parameters."""

    def __init__(
        self,
        *,
        servers: list[int],
        group: dist.ProcessGroup,
        shards: list[Shard],
        parameters: dict[str, torch.nn.Parameter],
    ) -> None:
        self.servers, self.group, self.shards = servers, group, shards
        self.parameters = [[parameters[name] for name in shard.names] for shard in shards]
        self.clock = 0  # steps pushed
        self.version = 0  # the servers' version of the parameters held now

    def pull(self) -> None:
        """The servers' parameters as they are (every worker starts from the same weights)."""
        self._round(lambda s: Request(Kind.PULL))

    def exchange(self, items: float = 1.0) -> None:
        """Push this step's gradients (weighted by `items`), then take the parameters the servers answer with
        (under the staleness bound: they may wait for slower workers)."""
        self._round(
            lambda s: Request(
                Kind.EXCHANGE,
                self.clock,
                self.version,
                items,
                gradient=self.shards[s].flatten([p.grad for p in self.parameters[s]]),
            )
        )
        self.clock += 1

    def save(self, directory: Path) -> bool:
        """Every server writes its shard into `directory` once every live worker asked; True for the worker
        that commits the directory."""
        replies = self._round(lambda s: Request(Kind.SAVE, self.clock, text=str(directory)))
        return replies[0].commit

    def load(self, directory: Path) -> int:
        """Every server restores its shard from `directory`; returns the step the checkpoint was taken at."""
        replies = self._round(lambda s: Request(Kind.LOAD, self.clock, text=str(directory)))
        self.clock = self.version = replies[0].clock
        return self.clock

    def finish(self) -> None:
        """Tell every server this worker is done (no answer comes)."""
        works = [w for server in self.servers for w in send_request(Request(Kind.DONE, self.clock), server, self.group)]
        for work in works:
            work.wait()

    def _round(self, request_for: Callable[[int], Request]) -> list[Reply]:
        sends: list[tuple[int, dist.Work]] = []
        for index, server in enumerate(self.servers):
            with _server_gone_stops_the_job(server):  # (a send to a server already gone fails at once)
                sends += [(server, work) for work in send_request(request_for(index), server, self.group)]
        replies = []
        for index, server in enumerate(self.servers):
            shard = self.shards[index]
            with _server_gone_stops_the_job(server):
                reply = recv_reply(server, shard.numel, shard.dtype, self.group)
            if reply.error:
                raise ParameterServerError(reply.error)
            if reply.parameters is not None:
                with torch.no_grad():
                    for param, value in zip(self.parameters[index], shard.views(reply.parameters), strict=True):
                        param.copy_(value)
            replies.append(reply)
        for server, work in sends:
            with _server_gone_stops_the_job(server):
                work.wait()
        self.version = min(reply.version for reply in replies)
        return replies


@contextlib.contextmanager
def _server_gone_stops_the_job(server: int) -> Iterator[None]:
    """A transport error talking to `server` is that server lost: one line, and the job stops."""
    try:
        yield
    except RuntimeError as err:
        raise ParameterServerError(
            f"parameter server rank {server} is gone ({str(err).strip().splitlines()[0][:160]}): the job "
            "stops, since it held its share of the weights; restart with checkpoint.resume=auto"
        ) from None
