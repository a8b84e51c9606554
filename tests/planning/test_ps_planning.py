"""The parameter server in numbers: memory, traffic per step, and the planner's advice."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from meshkit.cli import app
from meshkit.planning.estimate import ModelShape
from meshkit.planning.estimate_ps import advice, server_memory, traffic, worker_memory
from meshkit.planning.plan import Cluster

MODEL = ModelShape.transformer(layers=12, hidden=768, heads=12, vocab=50257)


def test_traffic_is_two_psi_per_worker_and_ring_allreduce_two_psi_n_minus_one_over_n() -> None:
    moved = traffic(ModelShape(1e9), servers=2, workers=6)
    assert moved.per_worker_gb == pytest.approx(8.0)  # 2Ψ of 4-byte elements
    assert moved.per_server_gb == pytest.approx(8.0 * 6 / 2)
    assert moved.ring_per_rank_gb == pytest.approx(8.0 * 7 / 8)


def test_server_memory_is_its_share_of_weights_and_optimizer_plus_the_waiting_gradients() -> None:
    server = {line.name: line.gb for line in server_memory(ModelShape(1e9), "adam", servers=4, workers=3).lines}
    assert server["params"] == pytest.approx(1.0) and server["optimizer"] == pytest.approx(2.0)
    assert server["grads"] == pytest.approx(3.0)
    worker = {
        line.name: line.gb
        for line in worker_memory(
            ModelShape(1e9), seq_len=128, micro_batch=1, precision="fp32", activation_checkpointing="none"
        ).lines
    }
    assert worker["optimizer"] == 0.0 and worker["params"] == pytest.approx(4.0)


def test_the_planner_advises_a_parameter_server_for_stragglers_and_slow_links_only() -> None:
    fast = Cluster(8, 80.0, 1, "nvlink", "ib")
    assert advice(MODEL, fast, stragglers=False).startswith("parameter server: not advised")
    said = advice(MODEL, fast, stragglers=True)
    assert "worth trying strategy=parameter_server" in said and "slowest" in said
    slow_links = Cluster(4, 80.0, 4, "pcie", "ethernet")
    assert "slow or shared links" in advice(MODEL, slow_links, stragglers=False)


def test_estimate_command_gives_server_and_worker_memory_and_traffic() -> None:
    result = CliRunner().invoke(app, ["estimate", "--params", "1e8", "--ps-servers", "2", "--dp", "6", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["traffic"]["per_server_gb"] == pytest.approx(2.4)
    assert data["server"]["grads_gb"] == pytest.approx(1.2) and data["worker"]["optimizer_gb"] == 0.0
