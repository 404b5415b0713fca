"""Lint the NCCL_* (and PyTorch's TORCH_NCCL_*) environment before a launch.

The known names are NCCL's documented environment variables (docs.nvidia.com/deeplearning/nccl,
user-guide/docs/env.html, 2.4 - 2.2x), written out here so the lint runs offline."""

from collections.abc import Mapping
from pathlib import Path

from dstrain.config.suggest import closest
from dstrain.doctor.findings import Check, fail, ok, warn

SECTION = "nccl env"
NET_SYSFS = Path("/sys/class/net")

# NCCL's "System configuration" and "Debugging" sections, plus names of older releases that
# NCCL still documents (NCCL_IB_GDR_LEVEL, NCCL_MAX_NRINGS, ...).
_DOCUMENTED = """
    NCCL_SOCKET_IFNAME NCCL_SOCKET_FAMILY NCCL_SOCKET_RETRY_CNT NCCL_SOCKET_RETRY_SLEEP_MSEC
    NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD NCCL_CROSS_NIC NCCL_IB_HCA NCCL_IB_TIMEOUT
    NCCL_IB_RETRY_CNT NCCL_IB_GID_INDEX NCCL_IB_ADDR_FAMILY NCCL_IB_ADDR_RANGE
    NCCL_IB_ROCE_VERSION_NUM NCCL_IB_SL NCCL_IB_TC NCCL_IB_FIFO_TC NCCL_IB_RETURN_ASYNC_EVENTS
    NCCL_IB_AR_THRESHOLD NCCL_IB_CUDA_SUPPORT NCCL_IB_QPS_PER_CONNECTION NCCL_IB_SPLIT_DATA_ON_QPS
    NCCL_IB_PCI_RELAXED_ORDERING NCCL_IB_ADAPTIVE_ROUTING NCCL_IB_ECE_ENABLE NCCL_IB_MERGE_NICS
    NCCL_IB_MERGE_VFS NCCL_IB_USE_INLINE NCCL_IB_DISABLE NCCL_IB_GDR_LEVEL NCCL_OOB_NET_ENABLE
    NCCL_OOB_NET_IFNAME NCCL_UID_STAGGER_THRESHOLD NCCL_UID_STAGGER_RATE NCCL_NET
    NCCL_NET_PLUGIN NCCL_TUNER_PLUGIN NCCL_PROFILER_PLUGIN NCCL_ENV_PLUGIN NCCL_NET_GDR_LEVEL
    NCCL_NET_GDR_READ NCCL_NET_GDR_C2C NCCL_NET_SHARED_BUFFERS NCCL_NET_SHARED_COMMS
    NCCL_NET_DISABLE_INTRA NCCL_NET_FORCE_FLUSH NCCL_SINGLE_RING_THRESHOLD NCCL_LL_THRESHOLD
    NCCL_LL128_THRESHOLD NCCL_TREE_THRESHOLD NCCL_ALGO NCCL_PROTO NCCL_IGNORE_CPU_AFFINITY
    NCCL_CONF_FILE NCCL_DEBUG NCCL_DEBUG_FILE NCCL_DEBUG_SUBSYS NCCL_DEBUG_TIMESTAMP_FORMAT
    NCCL_DEBUG_TIMESTAMP_LEVELS NCCL_COLLNET_ENABLE NCCL_COLLNET_NODE_THRESHOLD NCCL_TOPO_FILE
    NCCL_TOPO_DUMP_FILE NCCL_SET_THREAD_NAME NCCL_SET_STACK_SIZE NCCL_GRAPH_REGISTER
    NCCL_LOCAL_REGISTER NCCL_LEGACY_CUDA_REGISTER NCCL_GRAPH_MIXING_SUPPORT NCCL_DMABUF_ENABLE
    NCCL_P2P_DISABLE NCCL_P2P_LEVEL NCCL_P2P_DIRECT_DISABLE NCCL_P2P_READ_ENABLE
    NCCL_P2P_USE_CUDA_MEMCPY NCCL_P2P_NET_CHUNKSIZE NCCL_P2P_NVL_CHUNKSIZE NCCL_P2P_PCI_CHUNKSIZE
    NCCL_P2P_LL_THRESHOLD NCCL_P2P_PXN_LEVEL NCCL_PXN_DISABLE NCCL_PXN_C2C NCCL_SHM_DISABLE
    NCCL_SHM_USE_CUDA_MEMCPY NCCL_SHM_MEMCPY_MODE NCCL_SHM_LOCALITY NCCL_BUFFSIZE NCCL_NTHREADS
    NCCL_MAX_NCHANNELS NCCL_MIN_NCHANNELS NCCL_MAX_NRINGS NCCL_MIN_NRINGS NCCL_RINGS
    NCCL_MAX_CTAS NCCL_MIN_CTAS NCCL_CGA_CLUSTER_SIZE NCCL_CHECKS_DISABLE NCCL_CHECK_POINTERS
    NCCL_LAUNCH_MODE NCCL_IGNORE_DISABLED_P2P NCCL_ALLOC_P2P_NET_LL_BUFFERS NCCL_COMM_BLOCKING
    NCCL_CUMEM_ENABLE NCCL_CUMEM_HOST_ENABLE NCCL_NVB_DISABLE NCCL_NVB_PRECONNECT
    NCCL_NVLS_ENABLE NCCL_NVLS_CHUNKSIZE NCCL_NVLS_NCHANNELS NCCL_MNNVL_ENABLE NCCL_MNNVL_UUID
    NCCL_MNNVL_CLIQUE_ID NCCL_RAS_ENABLE NCCL_RAS_ADDR NCCL_RAS_TIMEOUT_FACTOR
    NCCL_RUNTIME_CONNECT NCCL_WORK_FIFO_DEPTH NCCL_WORK_FIFO_BYTES NCCL_CTA_POLICY
    NCCL_WIN_ENABLE NCCL_GDRCOPY_ENABLE NCCL_GDRCOPY_FLUSH_ENABLE NCCL_GDRCOPY_SYNC_ENABLE
    NCCL_GDRCOPY_FIFO_ENABLE NCCL_NCHANNELS_PER_NET_PEER NCCL_COMM_ID NCCL_HOSTID
    NCCL_CREATE_THREAD_CONTEXT NCCL_L1_SHARED_MEMORY_CARVEOUT NCCL_NVLSTREE_MAX_CHUNKSIZE
"""
KNOWN = frozenset(_DOCUMENTED.split())
# PyTorch's own variables under their pre-2.2 spellings (PyTorch reads the TORCH_ ones now).
TORCH_RENAMED = {
    name: f"TORCH_{name}"
    for name in (
        "NCCL_ASYNC_ERROR_HANDLING",
        "NCCL_BLOCKING_WAIT",
        "NCCL_DESYNC_DEBUG",
        "NCCL_ENABLE_TIMING",
        "NCCL_TRACE_BUFFER_SIZE",
        "NCCL_ENABLE_MONITORING",
        "NCCL_HEARTBEAT_TIMEOUT_SEC",
    )
}
# NCCL's docs list these under "Debugging": not for production, may cost speed or hang.
DEBUG_ONLY = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NET_DISABLE_INTRA", "NCCL_ALGO",
              "NCCL_PROTO", "NCCL_CHECKS_DISABLE", "NCCL_LAUNCH_MODE")  # fmt: skip
DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")


def lint_nccl_env(
    env: Mapping[str, str], net_root: Path = NET_SYSFS, ib_active: bool = False
) -> list[Check]:
    """All findings about the NCCL environment. `ib_active`: an active InfiniBand port exists."""
    checks = _names(env) + _debug(env) + _error_handling(env)
    if "NCCL_SOCKET_IFNAME" in env:
        checks.append(socket_ifname_check(env["NCCL_SOCKET_IFNAME"], list_interfaces(net_root)))
    if env.get("NCCL_IB_DISABLE", "0").strip() not in ("", "0") and ib_active:
        checks.append(
            warn(
                SECTION,
                "NCCL_IB_DISABLE",
                f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']} on a host with an active InfiniBand "
                "port: NCCL falls back to TCP sockets",
                "unset NCCL_IB_DISABLE (select HCAs with NCCL_IB_HCA instead)",
            )
        )
    for name in DEBUG_ONLY:
        if name in env:
            checks.append(
                warn(
                    SECTION,
                    name,
                    f"{name}={env[name]} is a debugging knob (NCCL docs): it can cost bandwidth "
                    "or hide the real problem",
                    f"unset {name} once the issue it worked around is fixed",
                )
            )
    return checks or [ok(SECTION, "variables", "no NCCL_* variables set (NCCL's defaults)")]


def _names(env: Mapping[str, str]) -> list[Check]:
    checks = []
    for name in sorted(n for n in env if n.startswith("NCCL_")):
        if name in TORCH_RENAMED:
            new = TORCH_RENAMED[name]
            checks.append(
                warn(
                    SECTION,
                    name,
                    f"{name} is PyTorch's deprecated spelling"
                    + (f" (and {new} is also set, which wins)" if new in env else ""),
                    f"rename it to {new}",
                )
            )
        elif name not in KNOWN:
            guess = closest(name, KNOWN)
            hint = f"; did you mean {guess}?" if guess else ""
            checks.append(
                warn(
                    SECTION,
                    name,
                    f"{name} is not an NCCL variable: NCCL ignores it{hint}",
                    f"rename it to {guess}" if guess else f"remove {name} (see NCCL's env docs)",
                )
            )
    return checks


def _debug(env: Mapping[str, str]) -> list[Check]:
    level = env.get("NCCL_DEBUG")
    if level is None:
        return []
    if level.upper() in ("INFO", "TRACE"):
        return [
            warn(
                SECTION,
                "NCCL_DEBUG",
                f"NCCL_DEBUG={level} logs every communicator setup (and with TRACE every call) "
                "from every rank: noisy and slower in production",
                "NCCL_DEBUG=WARN (keep INFO for a one-off debugging run)",
            )
        ]
    if level.upper() not in DEBUG_LEVELS:
        return [
            warn(
                SECTION,
                "NCCL_DEBUG",
                f"NCCL_DEBUG={level} is not a level NCCL knows ({', '.join(DEBUG_LEVELS)})",
                "NCCL_DEBUG=WARN",
            )
        ]
    return [ok(SECTION, "NCCL_DEBUG", f"NCCL_DEBUG={level}")]


def _error_handling(env: Mapping[str, str]) -> list[Check]:
    handling = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", env.get("NCCL_ASYNC_ERROR_HANDLING"))
    checks = []
    if handling is not None and handling.strip() == "0":
        checks.append(
            warn(
                SECTION,
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "async error handling is off: a rank whose peer died waits in the collective "
                "until the job's wall-clock limit instead of failing at the timeout",
                "unset it (PyTorch's default) or set TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (or 3), "
                "so torchrun can restart the job",
            )
        )
    blocking = env.get("TORCH_NCCL_BLOCKING_WAIT", env.get("NCCL_BLOCKING_WAIT", "0"))
    if blocking.strip() not in ("", "0"):
        checks.append(
            warn(
                SECTION,
                "TORCH_NCCL_BLOCKING_WAIT",
                "blocking wait makes the CPU wait on every collective (no compute/communication "
                "overlap across the host) to get timeouts raised in Python",
                "unset TORCH_NCCL_BLOCKING_WAIT; async error handling (the default) already "
                "turns a timeout into an error",
            )
        )
    return checks


def list_interfaces(net_root: Path = NET_SYSFS) -> list[str] | None:
    """Interface names under `net_root`, or None where it cannot be listed (not Linux)."""
    try:
        return sorted(p.name for p in net_root.iterdir())
    except OSError:
        return None


def parse_ifname(spec: str) -> tuple[bool, bool, list[str]]:
    """(exclude, exact, entries) of an NCCL interface list. As NCCL reads it, the prefixes apply
    to the whole list: `^` first excludes it, then `=` makes every entry an exact name
    (`^=docker0,lo` excludes exactly docker0 and lo); otherwise entries are name prefixes."""
    exclude = spec.startswith("^")
    rest = spec.removeprefix("^")
    exact = rest.startswith("=")
    entries = [e.strip() for e in rest.removeprefix("=").split(",") if e.strip()]
    return exclude, exact, entries


def _hit(name: str, entries: list[str], exact: bool) -> bool:
    return any(name == e if exact else name.startswith(e) for e in entries)


def match_ifname(spec: str, interfaces: list[str]) -> list[str]:
    """The interfaces NCCL would use for NCCL_SOCKET_IFNAME=`spec`."""
    exclude, exact, entries = parse_ifname(spec)
    return [i for i in interfaces if _hit(i, entries, exact) != exclude]


def socket_ifname_check(spec: str, interfaces: list[str] | None) -> Check:
    """Does NCCL_SOCKET_IFNAME name (or leave) an interface that exists?"""
    name = "NCCL_SOCKET_IFNAME"
    if interfaces is None:
        return ok(SECTION, name, f"{name}={spec} (interfaces not listable here; not checked)")
    chosen = match_ifname(spec, interfaces)
    have = ", ".join(interfaces) or "none"
    if not chosen:
        return fail(
            SECTION,
            name,
            f"{name}={spec} matches no interface on this host (have: {have}); NCCL will fail "
            "with `no socket interface found`",
            f"set {name} to an existing interface, e.g. ={interfaces[0]}"
            if interfaces
            else f"unset {name}",
        )
    if spec.startswith("^"):
        return ok(SECTION, name, f"{name}={spec} leaves {', '.join(chosen)}")
    _, exact, entries = parse_ifname(spec)
    dead = [e for e in entries if not any(_hit(i, [e], exact) for i in interfaces)]
    if dead:
        return warn(
            SECTION,
            name,
            f"{name}={spec}: {', '.join(dead)} match no interface (have: {have}); using "
            f"{', '.join(chosen)}",
            "drop the entries that match nothing (a typo here can silently pick a slow NIC)",
        )
    return ok(SECTION, name, f"{name}={spec} selects {', '.join(chosen)}")
