"""A real two-node Slurm cluster on one machine, for trying slurm/multinode.sbatch without a cluster. Needs root.

    sudo python tools/minislurm.py 4 2          # brings the cluster up, submits the script, prints its output

One munged and one slurmctld in this machine's network namespace, and one slurmd per "node": each in its own
network namespace (tools/netns.py) with its own IP address and, through a UTS namespace, its own hostname, written
into /etc/hosts so every node resolves every other by name, as on a cluster. Everything is private to a temporary
folder (its own munge key and socket, ports, spool, logs) and stopped and removed on the way out.
"""
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository
from harness.jobs import REPO, free_port  # noqa: E402
from tools.netns import PREFIX, namespaces_unavailable, network_namespaces  # noqa: E402

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun", "nsenter", "unshare")
HOSTS_FILE = Path("/etc/hosts")


def slurm_unavailable():
    """Why this machine cannot run the mini cluster (a reason to skip), or None when it can."""
    missing = [name for name in DAEMONS if not shutil.which(name)]
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}): apt-get install slurm-wlm munge "
                f"(.ci/run does)")
    return namespaces_unavailable()


SLURM_CONF = """\
ClusterName={PREFIX}
SlurmctldHost=localhost({controller_ip})
SlurmctldPort={controller_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=10
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP
"""


class Cluster:
    def __init__(self, folder, hosts):
        self.folder, self.hosts = folder, hosts
        self.conf = folder / "slurm.conf"
        self.env_overrides = {"SLURM_CONF": str(self.conf)}  # what a client command needs to find this cluster
        self.env = dict(os.environ, **self.env_overrides)

    def command(self, *argv, timeout=30, check=True, cwd=None, env=None):
        """A Slurm client command (sbatch, squeue, scontrol...) against this cluster; its stdout."""
        env = dict(env or os.environ, **self.env_overrides)
        done = subprocess.run(list(map(str, argv)), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, argv))}: {done.stderr.strip()}")
        return done.stdout

    def job_state(self, job_id):
        fields = self.command("scontrol", "show", "job", job_id, check=False).split()
        return next((f.split("=", 1)[1] for f in fields if f.startswith("JobState=")), "UNKNOWN")

    def wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.command("sinfo", "--noheader", "--format=%t", check=False).split()
            if states and all(state == "idle" for state in states):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the nodes never became idle:\n{self.command('sinfo', check=False)}\n{self.logs()}")

    def wait_job(self, job_id, timeout):
        """Poll (sbatch --wait sleeps up to 32 s between polls) until the job ends; its final state."""
        deadline, state = time.monotonic() + timeout, "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                return state
            time.sleep(0.3)
        return f"{state} (still, after {timeout} s)"

    def logs(self):
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
                         for log in sorted(self.folder.glob("*.log")))


def _start(argv, log):
    with open(log, "w") as out:
        return subprocess.Popen(list(map(str, argv)), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def _hosts_lines(lines, tag):
    """Add lines to /etc/hosts (each tagged), and remove exactly those on the way out."""
    tagged = [f"{line}  # {tag}" for line in lines]
    HOSTS_FILE.write_text(HOSTS_FILE.read_text() + "".join(f"{line}\n" for line in tagged))
    try:
        yield
    finally:
        kept = [line for line in HOSTS_FILE.read_text().splitlines() if not line.endswith(f"# {tag}")]
        HOSTS_FILE.write_text("".join(f"{line}\n" for line in kept))


@contextlib.contextmanager
def slurm_cluster(nodes=2, cpus=2):
    """Bring the cluster up; yield a Cluster; stop and remove everything afterwards, whatever happened."""
    with tempfile.TemporaryDirectory(prefix=f"{PREFIX}-slurm-") as tmp, \
            network_namespaces(nodes, tag="s") as (bridge_ip, hosts), \
            _hosts_lines([f"{host.ip} {host.name}" for host in hosts], f"{PREFIX}-slurm-{os.getpid()}"):
        folder = Path(tmp)
        folder.chmod(0o755)  # munged refuses a socket folder others can write to
        cluster, daemons = Cluster(folder, hosts), []
        node_lines = "\n".join(f"NodeName={host.name} NodeAddr={host.ip} CPUs={cpus} State=UNKNOWN"
                               for host in hosts)
        cluster.conf.write_text(SLURM_CONF.format(PREFIX=PREFIX, controller_ip=bridge_ip, folder=folder,
                                                  controller_port=free_port(bridge_ip), slurmd_port=6818,
                                                  nodes=node_lines))
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        try:
            daemons.append(_start(["munged", "--foreground", f"--socket={folder}/munge.socket",
                                   f"--key-file={key}", f"--pid-file={folder}/munged.pid",
                                   f"--seed-file={folder}/munged.seed", f"--log-file={folder}/munged.log"],
                                  folder / "munged.out"))
            daemons.append(_start(["slurmctld", "-D", "-i", "-f", cluster.conf], folder / "slurmctld.out"))
            for host in hosts:  # `ip netns exec` would remount /sys, which breaks slurmd's cgroup plugin
                daemons.append(_start(["nsenter", f"--net=/run/netns/{host.name}", "unshare", "--uts", "sh", "-c",
                                       f"hostname {host.name} && exec slurmd -D -f {cluster.conf} -N {host.name}"],
                                      folder / f"slurmd-{host.name}.out"))
            cluster.wait_idle()
            yield cluster
        finally:
            cluster.command("scancel", "--full", "--user=root", check=False)
            cluster.command("scontrol", "shutdown", check=False)
            deadline = time.monotonic() + 5  # slurmctld and the slurmds stop on `scontrol shutdown`; munged not
            for daemon in reversed(daemons[1:]):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.wait(timeout=max(0.1, deadline - time.monotonic()))
            for daemon in daemons:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM): cleaning up"))  # run the finally blocks
    reason = slurm_unavailable()
    if reason:
        sys.exit(f"error: {reason}")
    with slurm_cluster() as cluster, tempfile.TemporaryDirectory(prefix="slurm-job-") as workdir:
        print(f"$ export SLURM_CONF={cluster.conf}\n$ sinfo\n{cluster.command('sinfo')}", flush=True)
        submit = ["sbatch", "--parsable", f"--chdir={workdir}", "slurm/multinode.sbatch", *sys.argv[1:]]
        print(f"$ {' '.join(submit)}", flush=True)
        job_id = cluster.command(*submit, cwd=REPO, env=dict(os.environ, NPROC_PER_NODE="1")).strip().split(";")[0]
        state = cluster.wait_job(job_id, timeout=300)
        for out in Path(workdir).glob("*.out"):
            print(f"--- {out.name}\n{out.read_text()}")
        print(f"job {job_id}: {state}")
    sys.exit(0 if state == "COMPLETED" else 1)


if __name__ == "__main__":
    main()
