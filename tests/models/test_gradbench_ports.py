"""The GradBench ports (benchmarks/gradbench/) checked at their smallest sizes;
the tests live with the ports (benchmarks/gradbench/test_gradbench_ports.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gradbench.test_gradbench_ports import (  # noqa: F401
    restore_framework_state,
    test_ba_sparse_layout,
    test_comparison_catches_a_wrong_derivative,
    test_det_at_ell_9,
    test_generators_replay_gradbench_draws,
    test_ht_jacobian_columns_in_gradbench_order,
    test_ht_poses_only_the_vertices_used,
    test_jax_peer,
    test_particle_reproduces_gradbench_expected_output,
    test_symbackprop_port,
    test_torch_peer,
)
