"""nest-fx profiler: measured per-op compute and memory, and collective bandwidth per network level.

    profile_model(name, device, ProfileOptions(tps=(1, 2), mbss=(1, 2)))  -> (Profile, ProfileStats)
    Profile.load(path) / profile.save(path)                                format nest-fx-profile/1
    calibrate(cluster, nproc=2)                                            -> (fitted Cluster, fits, samples)

See docs/profiler.md.
"""

from profiler.collectives import calibrate, fit_cluster
from profiler.model_profile import ProfileOptions, profile_model
from nest_fx.workload.profile_file import OpEntry, Profile, ProfileError, op_key
from profiler.timer import Timer

__all__ = [
    "calibrate",
    "fit_cluster",
    "ProfileOptions",
    "profile_model",
    "OpEntry",
    "Profile",
    "ProfileError",
    "op_key",
    "Timer",
]
