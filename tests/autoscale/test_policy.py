"""The autoscaling policy against synthetic signals, on a clock the test moves."""

from __future__ import annotations

import json

import pytest

from servelm.autoscale.policy import AutoscaleConfig, AutoscaleConfigError, Autoscaler

CONFIG = AutoscaleConfig(target=1000, min_replicas=1, max_replicas=10, scale_up_threshold=1.2,
                         scale_down_threshold=0.6, up_window_s=30, down_cooldown_s=300,
                         tick_s=5, boot_s=60)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Carries out decisions: started replicas boot for config.boot_s, drained ones go."""

    def __init__(self, config: AutoscaleConfig, num_ready: int):
        self.clock = Clock()
        self.scaler = Autoscaler(config, self.clock)
        self.num_ready = num_ready
        self.booting: list[float] = []  # ready times
        self.events: list[tuple[float, int]] = []

    def tick(self, total_signal: float) -> None:
        c = self.scaler.config
        self.num_ready += sum(1 for t in self.booting if t <= self.clock.now)
        self.booting = [t for t in self.booting if t > self.clock.now]
        d = self.scaler.decide(total_signal, self.num_ready, len(self.booting))
        if d.delta > 0:
            self.booting += [self.clock.now + c.boot_s] * d.delta
        elif d.delta < 0:
            self.num_ready += d.delta
        if d.delta:
            self.events.append((self.clock.now, d.delta))
        self.clock.now += c.tick_s

    def run(self, signal, seconds: float) -> None:
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.tick(signal(self.clock.now) if callable(signal) else signal)

    @property
    def size(self) -> int:
        return self.num_ready + len(self.booting)


def test_steady_load_near_a_threshold_does_not_oscillate():
    """Load hovering around the up threshold (3 replicas at 1.1-1.3 x target) and around
    the down threshold: one decision at most, then it holds for an hour."""
    import math

    fleet = Fleet(CONFIG, 3)
    wobble = lambda t: 3 * 1000 * (1.2 + 0.1 * math.sin(t / 7))
    fleet.run(wobble, 3600)
    assert len(fleet.events) <= 1
    sizes = set()
    fleet.events.clear()
    for _ in range(720):  # another hour of the same: no event at all
        fleet.tick(wobble(fleet.clock.now))
        sizes.add(fleet.size)
    assert fleet.events == [] and len(sizes) == 1

    fleet = Fleet(CONFIG, 4)
    fleet.run(lambda t: 4 * 1000 * (0.6 + 0.05 * math.sin(t / 11)), 3600)
    assert len(fleet.events) <= 1


def test_load_inside_the_dead_band_holds():
    fleet = Fleet(CONFIG, 3)
    fleet.run(3 * 1000 * 1.15, 3600)
    fleet.run(3 * 1000 * 0.65, 3600)
    assert fleet.events == [] and fleet.size == 3


def test_a_spike_scales_up_once_counting_booting_replicas():
    """From 2 replicas at target to 6 x target: one event of +4 after the up window, and
    none while the four boot (60 s, 12 ticks), though the ready replicas stay overloaded."""
    fleet = Fleet(CONFIG, 2)
    fleet.run(2000, 300)
    assert fleet.events == []
    spike_at = fleet.clock.now
    fleet.run(6000, 600)
    assert fleet.events == [(pytest.approx(spike_at + CONFIG.up_window_s), 4)]
    assert fleet.size == 6 and fleet.scaler.num_scale_ups == 1


def test_booting_replicas_count_as_capacity():
    c = AutoscaleConfig(target=1000, max_replicas=10, up_window_s=0, down_cooldown_s=300)
    clock = Clock()
    scaler = Autoscaler(c, clock)
    # 2 ready, 3 booting: 5,000 tokens fits 5 replicas: nothing more is ordered.
    assert scaler.decide(5000, 2, 3).delta == 0
    clock.now = 5.0
    # 7,000 wants 7: two more, not seven.
    assert scaler.decide(7000, 2, 3).delta == 2
    # Without counting the booting ones, the same signal would have asked for five.
    assert Autoscaler(c, Clock()).decide(7000, 2, 0).delta == 5


def test_a_short_blip_does_not_scale_up():
    fleet = Fleet(CONFIG, 2)
    fleet.run(2000, 100)
    fleet.run(8000, CONFIG.up_window_s - CONFIG.tick_s)  # gone before the window ends
    fleet.run(2000, 600)
    assert fleet.events == []


def test_a_drop_scales_down_only_after_the_cooldown():
    fleet = Fleet(CONFIG, 6)
    fleet.run(6000, 400)
    drop_at = fleet.clock.now
    fleet.run(1500, 1000)
    # Half at most per event, a cool-down apart (counted from the next measurement after
    # the first event), down to ceil(1500 / 1000 / 0.8) = 2.
    second = drop_at + 2 * CONFIG.down_cooldown_s + CONFIG.tick_s
    assert fleet.events == [(pytest.approx(drop_at + CONFIG.down_cooldown_s), -3),
                            (pytest.approx(second), -1)]
    assert fleet.size == 2


def test_no_scale_down_within_the_cooldown_of_a_scale_up():
    c = AutoscaleConfig(target=1000, max_replicas=10, up_window_s=10, down_cooldown_s=100,
                        tick_s=5, boot_s=20)
    fleet = Fleet(c, 2)
    fleet.run(5000, 30)  # up to 5 at t=10
    assert fleet.events == [(10.0, 3)]
    fleet.run(500, 200)  # drops right after: down once, cooldown after the up event
    ups, downs = fleet.events[0], fleet.events[1:]
    assert len(downs) == 1 and downs[0][0] >= ups[0] + c.down_cooldown_s


def test_bounds():
    c = AutoscaleConfig(target=100, min_replicas=2, max_replicas=3, up_window_s=0,
                        down_cooldown_s=0)
    clock = Clock()
    scaler = Autoscaler(c, clock)
    assert scaler.decide(10_000, 3).delta == 0  # at max: hold however loaded
    clock.now = 1.0
    assert scaler.decide(0, 1).num_replicas == 2  # below min: up at once
    clock.now = 2.0
    assert scaler.decide(0, 3).num_replicas == 2  # never below min


def test_config_file_and_errors_name_the_field(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"target": 500, "max_replicas": 3, "up_window_s": 2}))
    c = AutoscaleConfig.load(path)
    assert (c.target, c.max_replicas, c.up_window_s, c.signal) == \
        (500, 3, 2, "tokens_in_flight")
    cases = [({"target": 1, "targt": 2}, "targt"), ({}, "target"),
             ({"target": 1, "min_replicas": 3, "max_replicas": 2}, "max_replicas"),
             ({"target": 1, "signal": "cpu"}, "signal"),
             ({"target": 1, "scale_up_threshold": 0.9}, "scale_up_threshold"),
             ({"target": 1, "up_window_s": -1}, "up_window_s"),
             ({"target": 0}, "target"), ({"target": 1, "tick_s": "5"}, "tick_s"),
             ({"target": 1, "min_replicas": -1}, "min_replicas"),
             ({"target": 1, "min_replicas": 0, "max_replicas": 0}, "max_replicas"),
             ({"target": 1, "hold_timeout_s": 0}, "hold_timeout_s"),
             ({"target": 1, "max_replicas": 2.5}, "max_replicas")]
    for data, field in cases:
        path.write_text(json.dumps(data))
        with pytest.raises(AutoscaleConfigError, match=field):
            AutoscaleConfig.load(path)
    path.write_text("{not json")
    with pytest.raises(AutoscaleConfigError, match="not JSON"):
        AutoscaleConfig.load(path)
    with pytest.raises(AutoscaleConfigError, match="cannot read"):
        AutoscaleConfig.load(tmp_path / "missing.json")


def test_smoothing_keeps_noise_from_restarting_the_cooldown():
    """A light load with a high sample every 20 s: without smoothing each one restarts the
    cool-down and the fleet never shrinks; with a 60 s mean it shrinks once, after it."""
    import dataclasses

    noisy = lambda t: 8 * 1000 * (1.0 if int(t) % 20 == 0 else 0.2)
    fleet = Fleet(CONFIG, 8)
    fleet.run(noisy, 1800)
    assert fleet.events == []
    fleet = Fleet(dataclasses.replace(CONFIG, down_smoothing_s=60), 8)
    fleet.run(noisy, 400)
    ((t, delta),) = fleet.events  # to the mean's 3,200 / 0.8 = 4 or a little above
    assert t >= CONFIG.down_cooldown_s and -4 <= delta <= -3


def test_scale_to_zero_after_an_idle_cooldown_and_wake_at_once():
    c = AutoscaleConfig(target=1000, min_replicas=0, max_replicas=4, up_window_s=30,
                        down_cooldown_s=300, tick_s=5, boot_s=60)
    fleet = Fleet(c, num_ready=2)
    fleet.run(200, 400)  # a little work: down to one, never to zero while work goes on
    assert fleet.size == 1
    fleet.run(0, 290)  # idle, but not for a whole cool-down yet
    assert fleet.size == 1
    fleet.run(0, 20)
    assert fleet.size == 0 and fleet.events[-1][1] == -1
    quiet = len(fleet.events)
    fleet.run(0, 600)  # at zero with nothing to do: nothing happens
    assert fleet.size == 0 and len(fleet.events) == quiet
    woke_at = fleet.clock.now
    fleet.tick(3500)  # a held request's tokens: replicas ordered at once, no up window
    assert fleet.events[-1] == (woke_at, 4)  # ceil(3500 / 1000), within max_replicas
    assert fleet.size == 4


def test_min_replicas_one_never_goes_to_zero():
    fleet = Fleet(CONFIG, num_ready=1)
    fleet.run(0, 3000)
    assert fleet.size == 1 and not fleet.events


def _run_with_batch(fleet: Fleet, signal: float, seconds: float, demand) -> list:
    """Ticks with a fixed signal and a batch demand (a function of the time); the
    decisions."""
    c, decisions = fleet.scaler.config, []
    end = fleet.clock.now + seconds
    while fleet.clock.now < end:
        fleet.num_ready += sum(1 for t in fleet.booting if t <= fleet.clock.now)
        fleet.booting = [t for t in fleet.booting if t > fleet.clock.now]
        d = fleet.scaler.decide(signal, fleet.num_ready, len(fleet.booting),
                                batch=demand(fleet.clock.now))
        decisions.append(d)
        if d.delta > 0:
            fleet.booting += [fleet.clock.now + c.boot_s] * d.delta
        elif d.delta < 0:
            fleet.num_ready += d.delta
        if d.delta:
            fleet.events.append((fleet.clock.now, d.delta))
        fleet.clock.now += c.tick_s
    return decisions


def test_a_day_long_batch_adds_a_fraction_of_a_replica_not_the_maximum():
    from servelm.autoscale.policy import BatchBacklog, BatchDemand

    fleet = Fleet(CONFIG, 2)
    # 50,000 lines in 24 h at 0.8 lines/s per replica: 0.72 replicas' work
    demand = lambda t: BatchDemand((BatchBacklog(50_000, 86_400 - t),), line_rate=0.8)
    decisions = _run_with_batch(fleet, 1500, 3600, demand)
    assert 0.7 < decisions[0].batch_replicas < 0.8
    assert fleet.events == [] and fleet.size == 2  # 1.5 + 0.72 on 2: inside the dead band


def test_a_batch_near_its_deadline_scales_the_fleet_up():
    from servelm.autoscale.policy import BatchBacklog, BatchDemand

    fleet = Fleet(CONFIG, 2)
    demand = lambda t: BatchDemand((BatchBacklog(20_000, 3600 - t),), line_rate=0.8)
    decisions = _run_with_batch(fleet, 1500, 120, demand)
    # 20,000 lines in the hour less a boot at 0.8 lines/s: 7.06 replicas beside 1.5
    assert 7.0 < decisions[0].batch_replicas < 7.2
    ups = [d for d in decisions if d.delta > 0]
    assert ups and ups[0].reason == "up" and ups[0].num_replicas == 9
    assert fleet.size == 9 and fleet.size < CONFIG.max_replicas
    # The same interactive signal without the batch holds at 2
    alone = Fleet(CONFIG, 2)
    _run_with_batch(alone, 1500, 120, lambda t: None)
    assert alone.events == [] and alone.size == 2


def test_batch_replicas_takes_deadlines_earliest_first():
    from servelm.autoscale.policy import BatchBacklog, BatchDemand, batch_replicas

    soon, later = BatchBacklog(100, 1060), BatchBacklog(10_000, 86_460)
    demand = BatchDemand((later, soon), line_rate=0.5)
    need = batch_replicas(demand, boot_s=60, tick_s=5)
    assert need == pytest.approx(max(100 / (0.5 * 1000), 10_100 / (0.5 * 86_400)))
    assert batch_replicas(BatchDemand((soon,), 0.5), 60, 5) == pytest.approx(0.2)
    # due within a boot: the time a new replica could still help is one tick at least
    assert batch_replicas(BatchDemand((BatchBacklog(10, 30),), 1.0), 60, 5) == 2.0
    assert batch_replicas(BatchDemand((soon,), None), 60, 5) == 1.0  # nothing measured
    assert batch_replicas(BatchDemand((BatchBacklog(0, 10),), 1.0), 60, 5) == 0.0
    assert batch_replicas(None, 60, 5) == 0.0


def test_a_pending_batch_wakes_a_fleet_at_zero_and_keeps_it_from_idling():
    from servelm.autoscale.policy import BatchBacklog, BatchDemand

    config = AutoscaleConfig(target=1000, min_replicas=0, max_replicas=4, up_window_s=15,
                             down_cooldown_s=60, tick_s=5, boot_s=30)
    demand = lambda t: BatchDemand((BatchBacklog(100, 86_400),), line_rate=None)
    fleet = Fleet(config, 0)
    decisions = _run_with_batch(fleet, 0, 5, demand)
    assert decisions[0].reason == "wake" and decisions[0].num_replicas == 1
    _run_with_batch(fleet, 0, 600, demand)
    assert fleet.size == 1  # no interactive work for ten minutes, but a batch to run
    _run_with_batch(fleet, 0, 600, lambda t: BatchDemand((BatchBacklog(0, 86_400),), 1.0))
    assert fleet.size == 0  # its lines done: idle
