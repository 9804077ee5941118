"""Reporters: what a simulation writes while it runs.

A reporter is asked at every step whether it is ``due``; when it is, the
simulation calls ``report(sim, thermo)`` on *every* rank (gathering positions
or reducing energies is collective), and only rank 0 writes. ``thermo`` is
the dict of :meth:`Simulation.thermo` when some due reporter sets
``needs_thermo``. ``wants_stress(step)`` asks the simulation to evaluate the
stress at that step (for the pressure); stress costs a little extra, so it is
evaluated only at those steps. On a restart, ``start`` trims each output back
to the checkpoint's step so the files equal those of an uninterrupted run.

* :class:`ProgressBar`: steps/s, ns/day and ETA on rank 0 (stderr).
* :class:`ThermoLog`: CSV of step, time, energies, temperature and pressure.
* :class:`Trajectory`: extended XYZ (via ASE) in the original atom order,
  with velocities, forces and energy.
* :class:`EnergyPlot`: at the end, a PNG of energy and temperature vs time.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

__all__ = ["Reporter", "ProgressBar", "ThermoLog", "Trajectory", "EnergyPlot", "THERMO_COLUMNS"]

THERMO_COLUMNS = ("step", "time_fs", "potential_eV", "kinetic_eV", "total_eV", "conserved_eV", "temperature_K", "pressure_GPa")
_THERMO_KEYS = ("step", "time", "potential", "kinetic", "total", "conserved", "temperature", "pressure")


class Reporter:
    """Base reporter: never due, writes nothing.

    Parameters
    ----------
    every : report every this many steps (0: never).
    """

    needs_thermo = False

    def __init__(self, every: int = 0) -> None:
        if not (isinstance(every, int) and every >= 0):
            raise ValueError(f"{type(self).__name__}: every must be an integer >= 0, got {every!r}")
        self.every = every

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def wants_stress(self, step: int) -> bool:
        return False

    def start(self, sim) -> None:
        """Called once before the first step (on every rank)."""

    def report(self, sim, thermo: dict | None) -> None:
        """Called on every rank when :meth:`due`."""

    def finish(self, sim) -> None:
        """Called at the end of each ``run`` (on every rank)."""


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressBar(Reporter):
    """A progress bar on rank 0: steps/s, ns/day, ETA.

    Parameters
    ----------
    stream : where to write (default ``sys.stderr``).
    interval : seconds between updates on a terminal; elsewhere a line is
        written every 10 % of the run.
    """

    def __init__(self, stream=None, interval: float = 0.5, width: int = 24) -> None:
        super().__init__(every=1)
        self.stream, self.interval, self.width = stream, float(interval), int(width)

    def _out(self):
        return self.stream if self.stream is not None else sys.stderr

    def start(self, sim) -> None:
        self._t0 = time.perf_counter()
        self._step0 = sim.step
        self._last = -math.inf
        self._decile = -1
        self._tty = bool(getattr(self._out(), "isatty", lambda: False)())

    def due(self, step: int) -> bool:
        return True

    def line(self, sim) -> str:
        """The progress text for the current step."""
        done, total = sim.step - self._step0, max(sim.target_step - self._step0, 1)
        elapsed = time.perf_counter() - self._t0
        rate = done / elapsed if elapsed > 0 and done else 0.0
        ns_day = rate * sim.integrator.timestep * 86400 / 1e6
        eta = (total - done) / rate if rate else math.inf
        frac = min(done / total, 1.0)
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        return (
            f"step {sim.step}/{sim.target_step} [{bar}] {100 * frac:3.0f}%  {rate:.1f} steps/s  {ns_day:.3f} ns/day  ETA {_duration(eta)}"
        )

    def report(self, sim, thermo) -> None:
        if sim.rank != 0:
            return
        now = time.perf_counter()
        done, total = sim.step - self._step0, max(sim.target_step - self._step0, 1)
        if self._tty:
            if now - self._last >= self.interval or sim.step == sim.target_step:
                self._out().write("\r" + self.line(sim))
                self._out().flush()
                self._last = now
        else:
            decile = int(10 * done / total)
            if decile != self._decile:
                self._decile = decile
                print(self.line(sim), file=self._out(), flush=True)

    def finish(self, sim) -> None:
        if sim.rank == 0:
            if self._tty:
                self._out().write("\r" + self.line(sim) + "\n")
            elif self._decile < 10:
                print(self.line(sim), file=self._out())
            elapsed = time.perf_counter() - self._t0
            print(f"{sim.step - self._step0} steps in {_duration(elapsed)}", file=self._out(), flush=True)


class ThermoLog(Reporter):
    """CSV thermo log (columns :data:`THERMO_COLUMNS`) on rank 0.

    Parameters
    ----------
    path : the CSV file.
    every : steps between rows.
    pressure : evaluate the stress at logged steps for the pressure column.
    """

    needs_thermo = True

    def __init__(self, path: str | Path, every: int = 10, pressure: bool = True) -> None:
        super().__init__(every)
        self.path, self.pressure = Path(path), bool(pressure)

    def wants_stress(self, step: int) -> bool:
        return self.pressure and self.due(step)

    def start(self, sim) -> None:
        if sim.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if sim.restarted and self.path.is_file():
            with open(self.path, newline="") as handle:
                kept = [row for row in csv.DictReader(handle) if int(row["step"]) <= sim.step]
        with open(self.path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(THERMO_COLUMNS)
            for row in kept:
                writer.writerow([row[c] for c in THERMO_COLUMNS])

    def report(self, sim, thermo) -> None:
        if sim.rank != 0:
            return
        with open(self.path, "a", newline="") as handle:
            values = [thermo[k] for k in _THERMO_KEYS]
            csv.writer(handle).writerow([values[0]] + [f"{v:.12g}" for v in values[1:]])


def read_thermo(path: str | Path) -> dict[str, list[float]]:
    """Columns of a thermo CSV as lists of floats."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {c: [float(r[c]) for r in rows] for c in THERMO_COLUMNS}


class Trajectory(Reporter):
    """Extended-XYZ trajectory written by ASE on rank 0, atoms in the original order.

    Each frame carries velocities, forces and the potential energy (and the
    stress when it was evaluated), with ``step`` and ``time_fs`` in its info.

    Parameters
    ----------
    path : the ``.xyz`` file.
    every : steps between frames.
    """

    def __init__(self, path: str | Path, every: int = 100) -> None:
        super().__init__(every)
        self.path = Path(path)

    def start(self, sim) -> None:
        if sim.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if sim.restarted and self.path.is_file():
            import ase.io

            frames = [a for a in ase.io.read(self.path, index=":", format="extxyz") if int(a.info["step"]) <= sim.step]
            tmp = self.path.with_suffix(".tmp.xyz")
            ase.io.write(tmp, frames, format="extxyz")
            tmp.replace(self.path)
        else:
            self.path.unlink(missing_ok=True)

    def report(self, sim, thermo) -> None:
        from ase.calculators.singlepoint import SinglePointCalculator

        system = sim.system()  # collective gather, original order
        forces = sim.sharded.gather(sim.md.forces)
        if sim.rank != 0:
            return
        import ase.io

        atoms = system.to_ase()
        stress = sim.md.stress if sim.md.want_stress else None
        atoms.calc = SinglePointCalculator(
            atoms, energy=float(sim.md.energy), forces=forces.cpu().numpy(), stress=None if stress is None else stress.cpu().numpy()
        )
        atoms.info.update({"step": sim.step, "time_fs": sim.time})
        ase.io.write(self.path, atoms, format="extxyz", append=True)


class EnergyPlot(Reporter):
    """At the end, a PNG (matplotlib, Agg) of energy and temperature against time from the thermo CSV.

    Parameters
    ----------
    csv_path : the :class:`ThermoLog` file.
    png_path : the figure.
    """

    def __init__(self, csv_path: str | Path, png_path: str | Path) -> None:
        super().__init__(every=0)
        self.csv_path, self.png_path = Path(csv_path), Path(png_path)

    def finish(self, sim) -> None:
        if sim.rank == 0 and self.csv_path.is_file():
            plot_thermo(self.csv_path, self.png_path, title=getattr(sim, "title", None) or sim.integrator.name)


def plot_thermo(csv_path: str | Path, png_path: str | Path, title: str | None = None) -> Path:
    """Plot energies (relative to their first value) and temperature against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = read_thermo(csv_path)
    t = [x / 1000.0 for x in data["time_fs"]]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6), constrained_layout=True)
    for key, label in (("potential_eV", "potential"), ("kinetic_eV", "kinetic"), ("total_eV", "total"), ("conserved_eV", "conserved")):
        values = data[key]
        if values:
            top.plot(t, [v - values[0] for v in values], label=label)
    top.set_ylabel("E - E(0)  [eV]")
    top.legend(loc="best", fontsize="small")
    bottom.plot(t, data["temperature_K"], color="tab:red")
    bottom.set_ylabel("temperature [K]")
    bottom.set_xlabel("time [ps]")
    if title:
        top.set_title(title, fontsize="small", wrap=True)
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
