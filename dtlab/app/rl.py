"""Reinforcement learning over RPC: one agent drives observers, each stepping its own CartPole.

Processes: rank 0 is ``agent``, which holds the policy; ranks 1..K are ``observer1`` ..
``observerK``, each with its own seeded environment (``CartPole``, the classic
cart-pole dynamics written here in numpy: no download, no gymnasium). Every iteration:

1. the agent asks every observer at once (``rpc_async``) to play one episode;
2. an observer steps its environment and, for each step, asks the agent for an action
   (``rpc_sync`` back to the agent, which runs the policy and keeps the log-probability);
3. it returns the episode's rewards, and the agent updates the policy with REINFORCE:
   ``loss = -sum_t log pi(a_t | s_t) * (G_t - b) / s``, with ``G_t`` the discounted return,
   ``b`` and ``s`` the mean and spread of the iteration's returns (a baseline, and a scale).

Each observer's actions are sampled with its own generator on the agent, so a seed
fixes the whole run however the RPC threads interleave.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import nn
from torch.distributed import rpc

from dtlab.core.net import LOOPBACK, listening_sockets
from dtlab.core.progress import report
from dtlab.instrument.rpc import RpcWorker, current_worker, events_frame
from dtlab.launch.rpc import launch_rpc
from dtlab.read.rpc import call_matrix


class CartPole:
    """Cart-pole balancing (Barto, Sutton & Anderson 1983; gymnasium's CartPole-v1 constants).

    Reward 1 per step until the pole leans past 12 degrees, the cart leaves +-2.4, or
    ``max_steps`` pass.
    """

    GRAVITY, CART_MASS, POLE_MASS, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    THETA_LIMIT, X_LIMIT = 12 * math.pi / 180, 2.4

    def __init__(self, seed: int, max_steps: int = 200) -> None:
        self.rng, self.max_steps = np.random.default_rng(seed), max_steps
        self.state, self.t = np.zeros(4), 0

    def reset(self) -> np.ndarray:
        self.state, self.t = self.rng.uniform(-0.05, 0.05, 4), 0
        return self.state.astype(np.float32)

    def step(self, action: int) -> tuple[np.ndarray, float, bool]:
        x, x_dot, theta, theta_dot = self.state
        total_mass = self.CART_MASS + self.POLE_MASS
        force = self.FORCE if action == 1 else -self.FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + self.POLE_MASS * self.HALF_LENGTH * theta_dot**2 * sin) / total_mass
        theta_acc = (self.GRAVITY * sin - cos * temp) / (
            self.HALF_LENGTH * (4 / 3 - self.POLE_MASS * cos**2 / total_mass))
        x_acc = temp - self.POLE_MASS * self.HALF_LENGTH * theta_acc * cos / total_mass
        # Euler steps, as in the original
        self.state = np.array([x + self.TAU * x_dot, x_dot + self.TAU * x_acc,
                               theta + self.TAU * theta_dot, theta_dot + self.TAU * theta_acc])
        self.t += 1
        done = abs(self.state[0]) > self.X_LIMIT or abs(self.state[2]) > self.THETA_LIMIT or self.t >= self.max_steps
        return self.state.astype(np.float32), 1.0, done


def random_policy_reward(episodes: int = 100, seed: int = 0, max_steps: int = 200) -> float:
    """Mean episode reward of uniformly random actions: the bar a learned policy must clear."""
    env, rng = CartPole(10_000 + seed, max_steps), np.random.default_rng(seed)
    total = 0.0
    for _ in range(episodes):
        env.reset()
        done = False
        while not done:
            _, reward, done = env.step(int(rng.integers(2)))
            total += reward
    return total / episodes


@dataclass(frozen=True)
class ReinforceConfig:
    observers: int = 2
    iterations: int = 80  # each plays one episode per observer
    seed: int = 0
    lr: float = 0.01
    gamma: float = 0.99
    hidden: int = 32
    max_steps: int = 200
    rpc_timeout_s: float = 30.0
    bind_address: str = LOOPBACK

    def __post_init__(self) -> None:
        for name in ("observers", "iterations", "hidden", "max_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ReinforceConfig.{name}={value!r} is invalid: must be an integer >= 1")
        if not self.lr > 0 or not 0 < self.gamma <= 1 or not self.rpc_timeout_s > 0:
            raise ValueError(f"ReinforceConfig lr={self.lr!r}, gamma={self.gamma!r}, rpc_timeout_s="
                             f"{self.rpc_timeout_s!r}: need lr > 0, 0 < gamma <= 1, rpc_timeout_s > 0")


class Agent:
    """The policy, in process ``agent``; observers call ``select_action`` over RPC."""

    def __init__(self, cfg: ReinforceConfig, worker: RpcWorker) -> None:
        torch.manual_seed(cfg.seed)
        self.cfg, self.recorder = cfg, worker.recorder
        self.policy = nn.Sequential(nn.Linear(4, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 2))
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
        observers = range(1, cfg.observers + 1)
        self.generators = {k: torch.Generator().manual_seed(cfg.seed * 1000 + k) for k in observers}
        self.log_probs: dict[int, list[torch.Tensor]] = {k: [] for k in observers}

    def select_action(self, observer: int, state: torch.Tensor) -> int:
        t0 = time.perf_counter()
        probs = torch.softmax(self.policy(state), dim=-1)
        action = int(torch.multinomial(probs, 1, generator=self.generators[observer]))
        self.log_probs[observer].append(torch.log(probs[action]))
        self.recorder.phases.append(("forward", t0, time.perf_counter(), self.recorder.step))
        return action

    def update(self, rewards: dict[int, list[float]]) -> float:
        returns, log_probs = [], []
        for k in sorted(rewards):  # a fixed order: the same sum on every run
            g, episode = 0.0, []
            for r in reversed(rewards[k]):
                g = r + self.cfg.gamma * g
                episode.append(g)
            returns += episode[::-1]
            log_probs += self.log_probs[k]
            self.log_probs[k] = []
        ret = torch.tensor(returns)
        ret = (ret - ret.mean()) / (ret.std() + 1e-8) if len(ret) > 1 else ret - ret.mean()
        loss = -(torch.stack(log_probs) * ret).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss)


class Observer:
    """One environment, in process ``observer<k>``; plays an episode when the agent asks."""

    def __init__(self, index: int, seed: int, max_steps: int) -> None:
        self.index, self.env = index, CartPole(seed * 1000 + index, max_steps)
        self.recorder = current_worker().recorder

    def run_episode(self, agent: Any, iteration: int) -> list[float]:
        rec = self.recorder
        rec.step = iteration  # this worker's calls belong to the agent's iteration
        state, rewards, done = self.env.reset(), [], False
        while not done:
            action = rpc.rpc_sync(agent.owner(), _select_action, args=(agent, self.index, torch.from_numpy(state)))
            t0 = time.perf_counter()
            state, reward, done = self.env.step(action)
            rec.phases.append(("env", t0, time.perf_counter(), iteration))
            rewards.append(reward)
        return rewards


# Module-level functions and state: RPC sends functions by reference.
_finished = threading.Event()


def _select_action(agent: Any, observer: int, state: torch.Tensor) -> int:
    return agent.local_value().select_action(observer, state)


def _run_episode(observer: Any, agent: Any, iteration: int) -> list[float]:
    return observer.local_value().run_episode(agent, iteration)


def _finish() -> None:
    _finished.set()


def _process(worker: RpcWorker, cfg: ReinforceConfig) -> dict[str, Any]:
    if worker.rank > 0:
        _finished.wait()  # serve the agent until it is done (a dead agent: the launcher ends us)
        return {"listening": listening_sockets()}
    rec = worker.recorder
    agent = Agent(cfg, worker)
    agent_rref = rpc.RRef(agent)
    observers = {k: rpc.remote(f"observer{k}", Observer, args=(k, cfg.seed, cfg.max_steps))
                 for k in range(1, cfg.observers + 1)}
    rows = []
    for it in range(cfg.iterations):
        rec.step = it
        futures = {k: rpc.rpc_async(ob.owner(), _run_episode, args=(ob, agent_rref, it))
                   for k, ob in observers.items()}
        rewards = {k: f.wait() for k, f in futures.items()}
        with rec.phase("optimizer"):
            loss = agent.update(rewards)
        rows += [{"iteration": it, "observer": k, "episode": it * cfg.observers + k - 1, "reward": sum(r),
                  "loss": loss} for k, r in rewards.items()]
        report(step=it + 1, total=cfg.iterations, desc="reinforce iterations")
    rec.step = cfg.iterations
    for ob in observers.values():
        rpc.rpc_sync(ob.owner(), _finish)
    return {"rewards": rows, "listening": listening_sockets()}


@dataclass
class ReinforceResult:
    config: ReinforceConfig
    rewards: Any  # DataFrame: iteration, observer, episode, reward, loss
    random_reward: float  # mean reward of a random policy (random_policy_reward)
    names: tuple[str, ...]
    events: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    listening: dict[str, list[str]]
    wall_s: float

    def last_mean(self, episodes: int = 20) -> float:
        """Mean reward of the last ``episodes`` episodes."""
        return float(self.rewards.sort_values("episode")["reward"].iloc[-episodes:].mean())

    def events_frame(self) -> Any:
        return events_frame(self.events)

    def call_matrix(self, value: str = "calls") -> Any:
        return call_matrix(self.events_frame(), value)


def train(cfg: ReinforceConfig | None = None, *, progress: Any = True, record: bool = True) -> ReinforceResult:
    """Train a CartPole policy with REINFORCE, one agent and ``cfg.observers`` observers over RPC."""
    cfg = cfg or ReinforceConfig()
    names = ("agent",) + tuple(f"observer{k}" for k in range(1, cfg.observers + 1))
    out = launch_rpc(_process, names, args=(cfg,), rpc_timeout_s=cfg.rpc_timeout_s, bind_address=cfg.bind_address,
                     progress=progress, record=record)
    rewards = pd.DataFrame(out[0]["rewards"], columns=["iteration", "observer", "episode", "reward", "loss"])
    return ReinforceResult(cfg, rewards, random_policy_reward(seed=cfg.seed, max_steps=cfg.max_steps), names,
                           out.events, out.phases, {n: o["listening"] for n, o in zip(names, out)}, out.wall_s)


def reward_figure(result: ReinforceResult, window: int = 20) -> Any:
    """Episode rewards, their moving mean, and the random policy's mean (and 3x it)."""
    df = result.rewards.sort_values("episode")
    fig = Figure(figsize=(7.5, 3.4), layout="constrained")
    ax = fig.subplots()
    ax.plot(df["episode"], df["reward"], ".", color="tab:blue", alpha=0.35, label="episode reward")
    ax.plot(df["episode"], df["reward"].rolling(window, min_periods=1).mean(), color="tab:blue",
            label=f"mean of the last {window}")
    ax.axhline(result.random_reward, color="tab:gray", ls="--", label=f"random policy ({result.random_reward:.1f})")
    ax.axhline(3 * result.random_reward, color="tab:red", ls=":", label="3x random")
    ax.set(title=f"REINFORCE on CartPole: 1 agent, {result.config.observers} observers over RPC",
           xlabel="episode", ylabel="reward (steps balanced)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return fig
