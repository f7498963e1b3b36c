"""A Slurm site on this machine for the paths only a real cluster takes: 16 nodes of 8 GPUs, each
"node" a set of processes, pyxis, Apptainer or podman, Ray and the trainer stood in for.

Every command the batch scripts call is a stand-in here (``srun``, ``sbatch``, ``scontrol``,
``squeue``, ``scancel``, ``getent``, ``nvidia-smi``, ``enroot``, ``apptainer``, ``podman``, ``ray``
and the job's ``$PYTHON``) that records its arguments in ``calls.jsonl`` and keeps the semantics
the scripts rely on:

- ``sbatch`` runs the batch script in a session of its own (its process group is the job's),
  with Slurm's variables, appends its output to ``--output``; ``scontrol requeue`` runs it again
  (``SLURM_RESTART_COUNT``), on nodes outside its ``ExcNodeList``; ``scancel`` marks the job
  CANCELLED (COMPLETING, Reason=None) and signals its processes, SIGKILL ``kill_wait`` later.
  As on Slurm 22.05, a cancelled job that is still completing can be requeued, and the
  ``ExcNodeList`` of a running job cannot be changed.
- A heterogeneous job (``#SBATCH hetjob`` or ``:`` between options) gets its components' nodes
  in order, Slurm's ``*_HET_GROUP_<i>`` variables, one ``scontrol show job`` record and one
  ``squeue`` line per component; a step takes ``--het-group=<i>`` to run on component i, and a
  step naming nodes outside its component is refused, as Slurm refuses it.
- ``srun`` runs one task per node with ``SLURMD_NODENAME``; ``--kill-on-bad-exit=1`` ends the
  step when a task fails; SIGTERM reaches the tasks. With ``--container-image`` it is pyxis: a
  named container is unpacked (``unpack_s``) at the first step that names it on a node, and a
  step that attaches to one still unpacking is recorded as a race.
- Inside any container only the bound folders are "seen": a Ray readiness check or a trainer
  whose container lacks the node's Ray folder cannot reach the head (as a fresh ``/tmp`` would).
- ``ray start --head`` listens on its port; a worker's start fails when the port does not answer
  or its node is listed in ``ray_fails``; the readiness check sees the nodes whose Ray started.
- ``$PYTHON -m nemo_dapo.cli train`` is a fake trainer that records its arguments and
  environment and does what ``STUB_TRAINER`` says for its run (exit, or wait for a stop signal);
  any other ``$PYTHON`` call runs the real interpreter.

``site.json`` in the state folder (``STUB_SITE``) sets the site: nodes, GPUs, CPUs, drivers,
KillWait, the nodes whose Ray fails. :func:`install` writes it and the commands.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from itertools import zip_longest
from pathlib import Path

COMMANDS = ("srun", "sbatch", "scontrol", "squeue", "scancel", "getent", "nvidia-smi", "enroot", "apptainer",
            "podman", "ray", "python")  # fmt: skip
STATE = Path(os.environ.get("STUB_SITE", "/nonexistent"))


def install(folder: Path, **site) -> dict[str, str]:
    """Write the site (defaults below, ``site`` overriding) and its commands under ``folder``;
    returns the environment a submission needs (PATH first)."""
    config = {"nodes": [f"node{i:02d}" for i in range(1, 17)], "gpus": 8, "cpus": 32, "driver": "580.65.06",
              "drivers": {}, "kill_wait": 30, "grace": 0, "ray_fails": [], "unpack_s": 0.3,
              "lost_gpus": {}}  # fmt: skip
    config |= site
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    (folder / "site.json").write_text(json.dumps(config))
    for command in COMMANDS:
        launcher = folder / "bin" / command
        launcher.write_text(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                            f"import stub_site\nstub_site.main({command!r})\n")  # fmt: skip
        launcher.chmod(0o755)
    return {"STUB_SITE": str(folder), "PATH": f"{folder / 'bin'}:{os.environ['PATH']}",
            "PYTHON": str(folder / "bin" / "python"), "STUB_REAL_PYTHON": sys.executable}  # fmt: skip


def site() -> dict:
    return json.loads((STATE / "site.json").read_text())


def record(kind: str, **fields) -> None:
    entry = {"cmd": kind, "time": time.time(), "node": os.environ.get("SLURMD_NODENAME"),
             "job": os.environ.get("SLURM_JOB_ID"), **fields}  # fmt: skip
    with open(STATE / "calls.jsonl", "a") as log:
        log.write(json.dumps(entry) + "\n")


def calls(folder: Path, kind: str | None = None) -> list[dict]:
    path = folder / "calls.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in entries if kind is None or e["cmd"] == kind]


# ----------------------------------------------------------------------------- jobs
@contextlib.contextmanager
def jobs():
    """The job records, locked for reading and writing."""
    (STATE / "jobs").mkdir(exist_ok=True)
    with open(STATE / "jobs.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = STATE / "jobs" / "all.json"
        table = json.loads(path.read_text()) if path.exists() else {}
        yield table
        path.write_text(json.dumps(table))


def expand(hostlist: str) -> list[str]:
    """Slurm's host list syntax: ``node[01-03,07],other``."""
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", hostlist):
        match = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not match:
            names.append(part)
            continue
        for span in match.group(2).split(","):
            low, _, high = span.partition("-")
            for number in range(int(low), int(high or low) + 1):
                names.append(f"{match.group(1)}{number:0{len(low)}d}")
    return names


def option(args: list[str], *names: str, default=None):
    """The value of ``--name=value`` or ``--name value`` (the last given)."""
    found = default
    for i, arg in enumerate(args):
        for name in names:
            if arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
            elif arg == name and i + 1 < len(args):
                found = args[i + 1]
    return found


def sbatch(args: list[str]) -> int:
    """A job, or a heterogeneous job: ``#SBATCH hetjob`` in the script (or ``:`` between the options
    given) separates its components, each with its own ``--nodes``."""
    record("sbatch", argv=args)
    script_at = next(i for i, a in enumerate(args) if not a.startswith("-") and a != ":" and os.path.isfile(a))
    options, script, script_args = args[:script_at], os.path.abspath(args[script_at]), args[script_at + 1 :]
    directives = re.findall(r"^#SBATCH\s+(\S+)", Path(script).read_text(), re.M)
    components = [c + o for c, o in zip_longest(split_at(directives, "hetjob"), split_at(options, ":"), fillvalue=[])]
    given = components[0]
    with jobs() as table:
        job_id = str(100 + len(table))
        table[job_id] = {
            "state": "PENDING", "reason": "None", "restarts": 0, "exc": "", "nodes": [], "groups": [],
            "num_nodes": [int(option(c, "--nodes", "-N", default="1")) for c in components], "command": script,
            "args": script_args,
            "output": option(given, "--output", "-o", default=f"slurm-{job_id}.out").replace("%j", job_id),
            "name": option(given, "--job-name", "-J", default=Path(script).name), "time": option(given, "--time"),
            "env": dict(os.environ), "workdir": os.getcwd(), "signal_at": None, "batch_pid": None,
        }  # fmt: skip
    subprocess.Popen([sys.executable, "-S", __file__, "_supervise", job_id], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    print(job_id if "--parsable" in options else f"Submitted batch job {job_id}")
    return 0


def split_at(items: list[str], separator: str) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for item in items:
        if item == separator:
            parts.append([])
        else:
            parts[-1].append(item)
    return parts


def supervise(job_id: str) -> None:
    """The job's life: allocate, run the batch script, follow requeues, cancellation and KillWait."""
    while True:
        with jobs() as table:
            job = table[job_id]
            free = [n for n in site()["nodes"] if n not in expand(job["exc"] or "")]
            if len(free) < sum(job["num_nodes"]):
                job["reason"] = "ReqNodeNotAvail"
                return
            bounds = [sum(job["num_nodes"][:i]) for i in range(len(job["num_nodes"]) + 1)]
            groups = [free[a:b] for a, b in zip(bounds, bounds[1:])]
            job |= {"state": "RUNNING", "reason": "None", "nodes": free[: bounds[-1]], "groups": groups,
                    "start": time.time(), "requeue": False, "cancel": False, "signal_at": None}  # fmt: skip
        status = run_batch(job_id, job)
        with jobs() as table:
            job = table[job_id]
            if job["requeue"]:
                job |= {"state": "PENDING", "restarts": job["restarts"] + 1, "reason": "BeginTime"}
                continue
            job["state"] = "CANCELLED" if job["cancel"] else "COMPLETED" if status == 0 else "FAILED"
            job["exit"] = status
            return


def run_batch(job_id: str, job: dict) -> int:
    config, first = site(), job["groups"][0]
    env = job["env"] | {
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": ",".join(first), "SLURM_JOB_NUM_NODES": str(len(first)),
        "SLURM_CPUS_ON_NODE": str(config["cpus"]), "SLURM_GPUS_ON_NODE": str(config["gpus"]),
        "SLURM_SUBMIT_DIR": job["workdir"], "SLURM_JOB_PARTITION": "batch", "SLURMD_NODENAME": job["nodes"][0],
        "SLURM_JOB_NAME": job["name"],
    }  # fmt: skip
    if len(job["groups"]) > 1:  # what Slurm adds for a heterogeneous job, per component
        env["SLURM_HET_SIZE"] = str(len(job["groups"]))
        for index, nodes in enumerate(job["groups"]):
            env |= {f"SLURM_JOB_NODELIST_HET_GROUP_{index}": ",".join(nodes),
                    f"SLURM_JOB_NUM_NODES_HET_GROUP_{index}": str(len(nodes)),
                    f"SLURM_JOB_ID_HET_GROUP_{index}": component_id(job_id, index),
                    f"SLURM_JOB_CPUS_PER_NODE_HET_GROUP_{index}": f"{config['cpus']}(x{len(nodes)})",
                    f"SLURM_GPUS_PER_NODE_HET_GROUP_{index}": str(config["gpus"])}  # fmt: skip
    if job["restarts"]:
        env["SLURM_RESTART_COUNT"] = str(job["restarts"])
    spool = STATE / "spool" / f"job{job_id}.{job['restarts']}"  # Slurm runs a copy of the script
    spool.parent.mkdir(exist_ok=True)
    spool.write_text(Path(job["command"]).read_text())
    with open(job["output"], "a") as out:
        batch = subprocess.Popen(["bash", str(spool), *job["args"]], env=env, cwd=job["workdir"], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    with jobs() as table:
        table[job_id]["batch_pid"] = batch.pid
    terminated = False
    while batch.poll() is None:
        time.sleep(0.1)
        with jobs() as table:
            signal_at = table[job_id]["signal_at"]
        if signal_at and not terminated:
            terminated = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(batch.pid, signal.SIGTERM)
        if signal_at and time.time() > signal_at + config["kill_wait"]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(batch.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # what the job leaves behind ends with it
        os.killpg(batch.pid, signal.SIGKILL)
    return batch.returncode


def end_job(job_id: str, *, requeue: bool) -> None:
    """``scancel`` (requeue False) or ``scontrol requeue``: the job's processes get TERM from the
    supervisor at its next look (Slurm's agent signals after the request returns)."""
    with jobs() as table:
        job = table[job_id]
        job |= {"requeue": True, "cancel": False} if requeue else {"cancel": True, "state": "COMPLETING"}
        job["signal_at"] = job["signal_at"] or time.time()


def scontrol(args: list[str]) -> int:
    record("scontrol", argv=args)
    if args[:2] == ["show", "hostnames"]:
        print("\n".join(expand(args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"])))
    elif args[:2] == ["show", "config"]:
        print(f"KillWait                = {site()['kill_wait']} sec")
    elif args[:2] == ["show", "partition"]:
        print(f"PartitionName=batch AllowGroups=ALL GraceTime={site()['grace']} State=UP")
    elif args[:2] == ["show", "job"]:
        return show_job(args[2] if len(args) > 2 else "")
    elif args[:1] == ["requeue"]:
        with jobs() as table:
            state = table.get(args[1], {}).get("state")
        if state not in ("RUNNING", "COMPLETING"):
            print(f"Requested operation is presently disabled for job {args[1]}", file=sys.stderr)
            return 1
        end_job(args[1], requeue=True)
    elif args[:1] == ["update"]:
        fields = dict(a.split("=", 1) for a in args[1:])
        with jobs() as table:
            job = table[fields["JobId"].partition("+")[0]]  # a component's: the stub keeps one list
            if job["state"] == "RUNNING" and not job["requeue"]:
                print(f"Job is no longer pending execution for job {fields['JobId']}", file=sys.stderr)
                return 1
            job["exc"] = fields.get("ExcNodeList", job["exc"])
    return 0


def component_id(job_id: str, index: int) -> str:
    """A heterogeneous job's component, as its own job id (Slurm numbers them on from the leader)."""
    return f"{job_id}+{index}" if index else job_id


def show_job(job_id: str) -> int:
    """The job's record; a heterogeneous job's leader shows one per component, as Slurm does."""
    if "SLURM_JOB_ID" not in os.environ and login_node_timeout():
        print("slurm_load_jobs error: Socket timed out on send/recv operation", file=sys.stderr)
        return 1
    leader, _, index = job_id.partition("+")
    with jobs() as table:
        job = table.get(leader)
    if job is None:
        print("slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
        return 1
    state = "COMPLETING" if job["state"] == "RUNNING" and (job["requeue"] or job["cancel"]) else job["state"]
    groups = job["groups"] or [job["nodes"]]
    for shown in [int(index)] if index else range(len(groups)):
        print(f"JobId={component_id(leader, shown)} JobName={job['name']}\n   JobState={state} Reason={job['reason']} "
              f"Dependency=(null)\n   Requeue=1 Restarts={job['restarts']} BatchFlag=1 "
              f"ExitCode={job.get('exit', 0)}:0\n"
              f"   ReqNodeList=(null) ExcNodeList={job['exc'] or '(null)'}\n   NodeList={','.join(groups[shown])}\n"
              f"   Command={job['command']}\n   WorkDir={job['workdir']}\n")  # fmt: skip
    return 0


def login_node_timeout() -> bool:
    """Whether this login-node query is one of the site's ``scontrol_failures`` (slurmctld busy)."""
    counter = STATE / "scontrol_failures"
    left = int(counter.read_text()) if counter.exists() else site().get("scontrol_failures", 0)
    counter.write_text(str(max(left - 1, 0)))
    return left > 0


def scancel(args: list[str]) -> int:
    record("scancel", argv=args)
    job_id, sig = args[-1], option(args, "--signal", "-s")
    if sig is None:
        end_job(job_id, requeue=False)
        return 0
    with jobs() as table:
        pid = table[job_id]["batch_pid"]
    number = getattr(signal, "SIG" + sig.removeprefix("SIG"))
    if "--batch" in args or "-b" in args:
        os.kill(pid, number)
    else:
        os.killpg(pid, number)
    return 0


def squeue(args: list[str]) -> int:
    record("squeue", argv=args)
    with jobs() as table:
        job = table.get(option(args, "-j", "--jobs", default=""))
    if job is None:
        return 1
    fmt = option(args, "-o", "--format", default="%T")
    for _ in job["groups"] or [job["nodes"]]:  # a line per component
        print(fmt.replace("%T", job["state"]).replace("%e", end_time(job)))
    return 0


def end_time(job: dict) -> str:
    """squeue's %e: the start plus the time limit (HH:MM:SS or minutes), Unknown without one."""
    if not job["time"] or "start" not in job:
        return "Unknown"
    parts = [int(p) for p in job["time"].split(":")]
    seconds = parts[0] * 60 if len(parts) == 1 else sum(p * 60**i for i, p in enumerate(reversed(parts)))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(job["start"] + seconds))


# ----------------------------------------------------------------------------- steps
VALUED = {"--nodes", "-N", "--ntasks", "-n", "--nodelist", "-w", "--cpus-per-task", "-c", "--output", "-o",
          "--error", "-e", "--container-image", "--container-name", "--container-mounts", "--container-workdir",
          "--container-env", "--wait", "--relative", "--ntasks-per-node", "--het-group", "--export"}  # fmt: skip


def split_options(args: list[str]) -> tuple[list[str], list[str]]:
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in VALUED else 1
    return args[:i], args[i:]


def srun(args: list[str]) -> int:
    options, command = split_options(args)
    job, group = os.environ["SLURM_JOB_ID"], option(options, "--het-group")
    allocation = expand(os.environ[f"SLURM_JOB_NODELIST_HET_GROUP_{group}" if group else "SLURM_JOB_NODELIST"])
    listed = option(options, "--nodelist", "-w")
    first = int(option(options, "--relative", default="0"))
    nodes = expand(listed) if listed else allocation[first : first + int(option(options, "--nodes", "-N", default="1"))]
    if not set(nodes) <= set(allocation):  # a node of another component without its --het-group
        print(f"srun: error: Unable to create step for job {job}: Requested node configuration is not available",
              file=sys.stderr)  # fmt: skip
        return 1
    image, name = option(options, "--container-image"), option(options, "--container-name")
    mounts, workdir = option(options, "--container-mounts", default=""), option(options, "--container-workdir")
    record("srun", argv=args, options=options, command=command, nodes=nodes, step_job=job)
    env = dict(os.environ)
    if image or name:
        env |= {"STUB_CONTAINER": "pyxis", "STUB_MOUNTS": mounts, "STUB_CONTAINER_NAME": name or ""}
        unpacking = [threading.Thread(target=pyxis_container, args=(node, job, name)) for node in nodes]
        for thread in unpacking:  # each node unpacks its own
            thread.start()
        for thread in unpacking:
            thread.join()
    output = option(options, "--output", "-o")
    out = open(output.replace("%j", job), "a") if output else None  # noqa: SIM115
    tasks = []
    for rank, node in enumerate(nodes):
        task_env = env | {"SLURMD_NODENAME": node, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank),
                          "SLURM_CPUS_PER_TASK": option(options, "--cpus-per-task", "-c", default="1")}  # fmt: skip
        cwd = host_path(workdir, mounts) if workdir else os.getcwd()
        tasks.append(subprocess.Popen(command, env=task_env, cwd=cwd, stdout=out, stderr=out))

    def stop(*_):
        for task in tasks:
            with contextlib.suppress(ProcessLookupError):
                task.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    kill_on_bad_exit = option(options, "--kill-on-bad-exit", default="0") == "1"
    failed = 0
    while any(task.poll() is None for task in tasks):
        bad = [task.returncode for task in tasks if task.returncode not in (None, 0)]
        if bad and not failed:
            failed = bad[0]
            if kill_on_bad_exit:
                record("srun-killed-step", nodes=nodes, status=failed)
                stop()
        time.sleep(0.05)
    statuses = [task.returncode for task in tasks]
    return next((s if s > 0 else 128 - s for s in statuses if s), 0)


def host_path(path: str, mounts: str) -> str:
    """Where a path inside the container lives on the node (through its mounts)."""
    for mount in mounts.split(","):
        source, _, target = mount.partition(":")
        if target and (path == target or path.startswith(target.rstrip("/") + "/")):
            return source + path[len(target) :]
    return path


def pyxis_container(node: str, job: str, name: str | None) -> None:
    """The node's named container: unpacked by the first step naming it; a step finding it still
    unpacking is a race (pyxis has no lock: it may run on a half-unpacked root)."""
    folder = STATE / "nodes" / node / "containers"
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / f"pyxis_{job}_{name or 'unnamed'}"
    if name and marker.exists():
        if marker.read_text() == "unpacking":
            record("pyxis-race", node=node, container=marker.name)
        return
    marker.write_text("unpacking")
    record("pyxis-unpack", node=node, container=marker.name)
    time.sleep(site()["unpack_s"])
    marker.write_text("ready")
    if not name:
        marker.unlink()


def enroot(args: list[str]) -> int:
    record("enroot", argv=args)
    folder = STATE / "nodes" / os.environ["SLURMD_NODENAME"] / "containers"
    if args[:1] == ["list"]:
        print("\n".join(p.name for p in sorted(folder.glob("*"))) if folder.exists() else "")
    elif args[:1] == ["remove"]:
        for container in args[1:]:
            if not container.startswith("-"):
                (folder / container).unlink(missing_ok=True)
    return 0


def apptainer(args: list[str]) -> int:
    record("apptainer", argv=args)
    binds, workdir = option(args, "--bind", default=""), option(args, "--pwd")
    rest = args[1:]
    while rest and rest[0].startswith("-"):
        rest = rest[2:] if rest[0] in ("--bind", "--pwd") else rest[1:]
    env = os.environ | {"STUB_CONTAINER": "apptainer", "STUB_MOUNTS": binds}
    return subprocess.call(rest[1:], env=env, cwd=workdir)


def podman(args: list[str]) -> int:
    record("podman", argv=args)
    if args[:2] == ["image", "inspect"]:
        print("PATH=/opt/venv/bin:/usr/bin:/bin")
        return 0
    if args[:1] != ["run"]:
        return 0
    volumes = [args[i + 1] for i, a in enumerate(args) if a == "--volume"]
    rest, i = args[1:], 0
    while i < len(rest) and rest[i].startswith("-"):
        i += 2 if rest[i] in ("--env", "--volume", "--workdir") else 1
    env = os.environ | {"STUB_CONTAINER": "podman", "STUB_MOUNTS": ",".join(volumes)}
    return subprocess.call(rest[i + 1 :], env=env, cwd=option(args, "--workdir"))


def getent(args: list[str]) -> int:
    if args[-1] not in site()["nodes"]:
        return 2
    print(f"127.0.0.1       STREAM {args[-1]}\n127.0.0.1       DGRAM\n127.0.0.1       RAW")
    return 0


def nvidia_smi(args: list[str]) -> int:
    config, node = site(), os.environ.get("SLURMD_NODENAME", "")
    gpus = config["lost_gpus"].get(node, config["gpus"])
    driver = config["drivers"].get(node, config["driver"])
    if any("driver_version" in a for a in args):
        print("\n".join([driver] * gpus))
    else:
        print("\n".join(["NVIDIA H800, 81559"] * gpus))
    return 0


# ----------------------------------------------------------------------------- Ray and the job's Python
def ray_folder_seen() -> bool:
    """Inside a container, whether the node's Ray session folder is bound (else its /tmp is new)."""
    if not os.environ.get("STUB_CONTAINER"):
        return True
    bound = [mount.split(":")[1] for mount in os.environ.get("STUB_MOUNTS", "").split(",") if ":" in mount]
    return os.environ.get("RAY_TEMP_DIR", "?") in bound


def ray(args: list[str]) -> int:
    record("ray", argv=args)
    if args[:1] != ["start"] or any(not a.startswith("-") for a in args[1:]):  # as Ray's own parser
        print(f"Error: Got unexpected extra argument ({' '.join(args)})", file=sys.stderr)
        return 2
    job, node = os.environ["SLURM_JOB_ID"], os.environ["SLURMD_NODENAME"]
    joined = STATE / "ray" / job
    joined.mkdir(parents=True, exist_ok=True)
    server = None
    if "--head" in args:
        server = socket.create_server(("127.0.0.1", int(option(args, "--port"))))
    else:
        host, port = option(args, "--address").rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except OSError:
            print(f"ray: unable to connect to GCS at {host}:{port}", file=sys.stderr)
            return 1
        if node in site()["ray_fails"]:
            print("ray: the raylet exited during start-up", file=sys.stderr)
            return 1
    (joined / node).touch()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        if server is not None:
            server.settimeout(0.2)
            with contextlib.suppress(OSError):
                server.accept()[0].close()
        else:
            time.sleep(0.2)


def fake_ready(args: list[str]) -> int:
    seconds, nodes = float(args[0]), int(args[1])
    names = [item.split("=", 1)[0] for item in args[4:]]
    record("ready", argv=args, sees_ray=ray_folder_seen())
    if not ray_folder_seen():
        print(f"raylet_ipc_client: failed to connect to socket under {os.environ['RAY_TEMP_DIR']}", file=sys.stderr)
        return 1
    joined, deadline = STATE / "ray" / os.environ["SLURM_JOB_ID"], time.monotonic() + seconds
    while True:
        present = {p.name for p in joined.glob("*")} if joined.exists() else set()
        if len(present) >= nodes:
            print(f"nodes {len(present)}/{nodes}")
            return 0
        if time.monotonic() > deadline:
            print(
                f"nodes {len(present)}/{nodes}"
                + "".join(f"\nmissing {n} (127.0.0.1)" for n in names if n not in present)
            )
            return 1
        time.sleep(0.2)


def fake_trainer(args: list[str]) -> int:
    """A run of `nemo-dapo train`: what STUB_TRAINER lists for this restart (the last repeats):
    ``exit:N``, ``stop`` (wait for USR1/TERM, then exit 3, or 4 before any step), ``save:N`` (the
    ``latest`` pointer of a checkpoint of step N), ``train:N`` (N step records in ``metrics.jsonl``)."""
    keep = ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTHONPATH", "HF_HOME", "XDG_CACHE_HOME", "RAY_ADDRESS", "STUB_CONTAINER",
            "STUB_MOUNTS", "STUB_CONTAINER_NAME", "SLURM_CPUS_PER_TASK", "NCCL_IB_HCA", "SLURMD_NODENAME")  # fmt: skip
    record("train", argv=args, cwd=os.getcwd(), env={k: os.environ.get(k) for k in keep}, sees_ray=ray_folder_seen())
    if not ray_folder_seen():
        print("ray.init: cannot connect to the raylet's socket (a new /tmp in this container)", file=sys.stderr)
        return 1
    if os.environ.get("NCCL_DEBUG") == "INFO":  # what NCCL prints when the fabric reached the container
        print("node01:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA", flush=True)
    runs = os.environ.get("STUB_TRAINER", "exit:0").split(";")
    actions = runs[min(int(os.environ.get("SLURM_RESTART_COUNT", "0")), len(runs) - 1)].split(",")
    output = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir=")))
    output.mkdir(parents=True, exist_ok=True)
    steps = 0
    for action in actions:
        kind, _, value = action.partition(":")
        if kind == "save":
            (output / "checkpoints").mkdir(exist_ok=True)
            (output / "checkpoints" / "latest").write_text(f"global_step_{value}")
            steps += 1
        elif kind == "train":  # step records as the tracker writes them (what `nemo-dapo bringup` reads)
            stages = {f"timing_s/{stage}": 1.0 for stage in ("gen", "old_log_prob", "update_actor", "sync_weights")}
            with open(output / "metrics.jsonl", "a") as metrics:
                for step in range(1, int(value) + 1):
                    metrics.write(json.dumps({"step": step, **stages, "perf/weight_sync_mb": 1.0}) + "\n")
            steps += int(value)
        elif kind == "exit":
            return int(value)
        elif kind == "stop":
            received = wait_for_stop()
            record("train-stopped", signal=received)
            return 3 if steps else 4
    return 0


def wait_for_stop() -> str:
    stopped: list[int] = []
    for number in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(number, lambda n, _: stopped.append(n))
    while not stopped:
        time.sleep(0.05)
    return signal.Signals(stopped[0]).name


def python(args: list[str]) -> int:
    if args[:3] == ["-m", "nemo_dapo.cli", "train"]:
        return fake_trainer(args[3:])
    if args and args[0].endswith("ray_ready.py"):
        return fake_ready(args[1:])
    os.execv(os.environ["STUB_REAL_PYTHON"], [os.environ["STUB_REAL_PYTHON"], *args])
    return 1


def main(command: str) -> None:
    handlers = {"srun": srun, "sbatch": sbatch, "scontrol": scontrol, "squeue": squeue, "scancel": scancel,
                "getent": getent, "nvidia-smi": nvidia_smi, "enroot": enroot, "apptainer": apptainer,
                "podman": podman, "ray": ray, "python": python}  # fmt: skip
    sys.exit(handlers[command](sys.argv[1:]))


if __name__ == "__main__" and sys.argv[1:2] == ["_supervise"]:
    supervise(sys.argv[2])
