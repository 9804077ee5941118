"""Run configuration files (YAML): what to simulate, with which models, how, and where to write.

A configuration is a YAML mapping with these sections (only ``system``, ``models``, ``integrator`` and
``steps`` are required)::

    name: argon                       # run directory name (default: the file's stem)
    system:
      generator: {type: argon, cells: 4}       # or: file: structure.xyz (any format ASE reads)
      velocities: {temperature: 300, seed: 1}  # Maxwell-Boltzmann start (else from the file, or zero)
    models:                           # name -> model type and its constructor parameters
      lj: {type: LennardJones, epsilon: 0.0104, sigma: 3.4, cutoff: 8.5}
      mace: {type: MACE, file: my.model}
    groups:                           # optional; default: one group per model
      - {steps: [lj], autograd: false}
      - {steps: [mace]}
    domain: {grid: null, skin: 1.0}   # unset keys: DomainConfig's defaults
    integrator: {type: langevin, timestep: 2.0, temperature: 300, friction: 0.01, seed: 0}
    steps: 10000
    nproc: 1
    outputs: {directory: runs/argon, thermo_every: 10, trajectory_every: 100, checkpoint_every: 1000}

Each section is a pydantic model (:mod:`.sections`; model types in :mod:`.models`, integrators in
:mod:`.integrators`); :func:`config_schema` exports them as a JSON schema for editors. Every value is checked
when the file is loaded: an unknown key, a missing file, a bad value, or a species of the system that a model
has no parameters for raises one :class:`ConfigError` naming the key (``integrator.timestep``,
``models.lj.cutoff``...). Per-species parameters are keyed by element symbol (``{Na: 0.01}``, also ``na``)
or pair (``{Na-Cl: 3.0}``). Relative paths are relative to the configuration file.
"""

from .errors import ConfigError
from .integrators import INTEGRATOR_TYPES, integrator_class
from .models import MODEL_SPECS, MODEL_TYPES, ModelSpec, resolve_model_type
from .run_config import RunConfig, config_schema, load_config, parse_config
from .sections import RunSpec

__all__ = [
    "ConfigError",
    "RunConfig",
    "RunSpec",
    "load_config",
    "parse_config",
    "config_schema",
    "MODEL_SPECS",
    "MODEL_TYPES",
    "ModelSpec",
    "INTEGRATOR_TYPES",
    "integrator_class",
    "resolve_model_type",
]
