"""occult-bench: a harness for communication-efficient expert parallelism.

Shape legend used across the code base (suffixes on tensor names):

    T  tokens on one rank           D  model hidden size
    F  expert FFN hidden size       E  routed experts of one layer
    K  top-k                        P  expert-parallel world size
    e  local experts on one rank    R  rows of a send / receive buffer
"""

from pathlib import Path

__version__ = "0.1.0"
# the config folder (conf/): every reader of its YAML files finds it here
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
