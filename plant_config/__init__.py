"""The plant file: YAML that says which node runs which layers of which model over which broker.

Agents call `load_plant`; `edgebus init` calls `init_plant_file`.
"""

from plant_config.broker_section import BrokerSettings
from plant_config.coordinator_section import CoordinatorSpec
from plant_config.layout import even_split
from plant_config.loader import init_plant_file, load_plant, make_plant, write_plant
from plant_config.schema import Liveness, PipelineStage, Plant, StageSpec

__all__ = [
    "BrokerSettings",
    "CoordinatorSpec",
    "Liveness",
    "PipelineStage",
    "Plant",
    "StageSpec",
    "even_split",
    "init_plant_file",
    "load_plant",
    "make_plant",
    "write_plant",
]
