"""Reporters: what a simulation writes while it runs.

A reporter is asked at every step whether it is ``due``; when it is, the
simulation calls ``report(sim, thermo)`` on *every* rank (gathering positions
or reducing energies is collective), and only rank 0 writes. ``thermo`` is
the dict of :meth:`Simulation.thermo` when some due reporter sets
``needs_thermo``. ``wants_stress(step)`` asks the simulation to evaluate the
stress at that step (for the pressure); stress costs a little extra, so it is
evaluated only at those steps. On a restart, ``start`` trims each output back
to the checkpoint's step so the files equal those of an uninterrupted run.

* :class:`ProgressBar`: a tqdm bar with steps/s, ns/day and ETA on rank 0
  (stderr); its rate is that of :attr:`Simulation.timing`, which run
  summaries print too.
* :class:`ThermoLog`: CSV of step, time, energies, temperature, pressure,
  volume and density.
* :class:`Trajectory`: extended XYZ (via ASE) in the original atom order,
  with velocities, forces and energy.
* :class:`EnergyPlot`: at the end, a PNG of the energies, the conserved-energy
  drift (the NVE check) on its own axis, temperature, pressure and density
  vs time.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

__all__ = [
    "Reporter",
    "ProgressBar",
    "ThermoLog",
    "Trajectory",
    "EnergyPlot",
    "THERMO_COLUMNS",
    "read_thermo",
    "thermo_figure",
    "plot_thermo",
]

THERMO_COLUMNS = (
    "step",
    "time_fs",
    "potential_eV",
    "kinetic_eV",
    "total_eV",
    "conserved_eV",
    "temperature_K",
    "pressure_GPa",
    "volume_A3",
    "density_g_cm3",
)
_THERMO_KEYS = ("step", "time", "potential", "kinetic", "total", "conserved", "temperature", "pressure", "volume", "density")


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

    def wants_energy(self, step: int) -> bool:
        """Whether :meth:`report` at ``step`` reads the potential energy (every due step, unless a reporter says otherwise)."""
        return self.due(step)

    def start(self, sim) -> None:
        """Called once before the first step (on every rank)."""

    def report(self, sim, thermo: dict | None) -> None:
        """Called on every rank when :meth:`due`."""

    def finish(self, sim) -> None:
        """Called at the end of each ``run`` (on every rank)."""


class ProgressBar(Reporter):
    """A progress bar (tqdm) on rank 0: steps, steps/s, ns/day and the time left.

    The rate is the stepping loop's (:class:`~halopipe.dynamics.simulation.RunTiming`):
    setup and the first evaluation are not counted, and the final line shows
    the same rate as a run summary.

    Parameters
    ----------
    stream : where to write (default ``sys.stderr``).
    interval : least seconds between updates.
    """

    def __init__(self, stream=None, interval: float = 0.5) -> None:
        super().__init__(every=1)
        self.stream, self.interval = stream, float(interval)
        self._bar = None

    def due(self, step: int) -> bool:
        return True

    def wants_energy(self, step: int) -> bool:
        return False

    def _open(self, sim):
        from tqdm import tqdm

        timing = sim.timing
        return tqdm(
            total=timing.target_step - timing.first_step,
            initial=sim.step - timing.first_step,
            file=self.stream if self.stream is not None else sys.stderr,
            mininterval=self.interval,
            unit="step",
            dynamic_ncols=True,
            bar_format="step {n}/{total} {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]",
        )

    def _show(self, sim) -> None:
        timing = sim.timing
        rate = timing.rate
        ns_day = rate * sim.integrator.timestep * 86400 / 1e6
        self._bar.set_postfix_str(f"{rate:.1f} steps/s, {ns_day:.3f} ns/day" if math.isfinite(rate) else "", refresh=False)
        self._bar.update(timing.steps - self._bar.n)

    def report(self, sim, thermo) -> None:
        if sim.rank != 0 or sim.timing is None or sim.timing.started is None:
            return  # the initial report during setup: the bar starts with the loop
        if self._bar is None:
            self._bar = self._open(sim)
            self._bar.start_t -= time.perf_counter() - sim.timing.started  # its clock starts with the loop, as the rate's
        self._show(sim)

    def finish(self, sim) -> None:
        if sim.rank != 0 or self._bar is None:
            return
        self._show(sim)
        self._bar.close()  # draws the final state once
        self._bar = None


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
                writer.writerow([row.get(c) or "nan" for c in THERMO_COLUMNS])  # a log from before a column existed

    def report(self, sim, thermo) -> None:
        if sim.rank != 0:
            return
        with open(self.path, "a", newline="") as handle:
            values = [thermo[k] for k in _THERMO_KEYS]
            csv.writer(handle).writerow([values[0]] + [f"{v:.12g}" for v in values[1:]])


def read_thermo(path: str | Path) -> dict[str, list[float]]:
    """Columns of a thermo CSV as lists of floats (NaN for a column an older log lacks)."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return {c: [float(r.get(c) or "nan") for r in rows] for c in THERMO_COLUMNS}


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

        system = sim.sharded.to_system(root=0)  # collective gather to rank 0, original order
        forces = sim.sharded.gather(sim.md.forces, root=0)
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
    """At the end, a PNG (matplotlib, Agg) of the thermo CSV against time (see :func:`thermo_figure`).

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
            title = getattr(sim, "title", None) or sim.integrator.name
            plot_thermo(self.csv_path, self.png_path, n_atoms=sim.sharded.n_total, title=title)


def thermo_figure(data: dict[str, list[float]], n_atoms: int, title: str | None = None):
    """A figure of a thermo log (columns as :func:`read_thermo` returns them), five panels sharing the time axis.

    1. potential, kinetic and total energy relative to their first values;
    2. the conserved quantity's drift, ``conserved - conserved(0)`` in meV/atom:
       flat for a sound NVE run (or thermostat run, whose conserved quantity
       includes the bath), so a drift shows here on its own scale;
    3. temperature;
    4. pressure (where it was evaluated);
    5. density (g/cm³; constant unless a barostat moves the cell).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x / 1000.0 for x in data["time_fs"]]
    fig, (energy, drift, temperature, pressure, density) = plt.subplots(5, 1, sharex=True, figsize=(7, 11), constrained_layout=True)
    for key, label in (("potential_eV", "potential"), ("kinetic_eV", "kinetic"), ("total_eV", "total")):
        values = data[key]
        if values:
            energy.plot(t, [v - values[0] for v in values], label=label)
    energy.set_ylabel("E - E(0)  [eV]")
    energy.legend(loc="best", fontsize="small")
    conserved = data["conserved_eV"]
    drift.plot(t, [(v - conserved[0]) * 1000.0 / n_atoms for v in conserved] if conserved else [], color="black")
    drift.set_ylabel("conserved drift\n[meV/atom]")
    temperature.plot(t, data["temperature_K"], color="tab:red")
    temperature.set_ylabel("temperature [K]")
    finite = [(x, p) for x, p in zip(t, data["pressure_GPa"]) if math.isfinite(p)]
    pressure.plot([x for x, _ in finite], [p for _, p in finite], color="tab:blue")
    pressure.set_ylabel("pressure [GPa]")
    finite = [(x, d) for x, d in zip(t, data["density_g_cm3"]) if math.isfinite(d)]
    density.plot([x for x, _ in finite], [d for _, d in finite], color="tab:green")
    density.set_ylabel("density [g/cm³]")
    density.set_xlabel("time [ps]")
    if title:
        energy.set_title(title, fontsize="small", wrap=True)
    return fig


def plot_thermo(csv_path: str | Path, png_path: str | Path, n_atoms: int, title: str | None = None) -> Path:
    """Write :func:`thermo_figure` of the thermo CSV at ``csv_path`` to ``png_path``."""
    import matplotlib.pyplot as plt

    fig = thermo_figure(read_thermo(csv_path), n_atoms, title)
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
