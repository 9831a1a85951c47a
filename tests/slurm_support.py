"""A real Slurm on this machine, of the test's own: Debian's slurm-wlm and munge (.ci/run installs
them), `slurmctld` and one `slurmd -N NAME` per node, every daemon on a free loopback port with its
state, spool and logs in the test's directory, and munge on a socket and key of its own, so
nothing of the machine's is touched. Each node has GPUs as Slurm's gres counts them: device files
of the test's (character devices, as /dev/nvidia* are), so `--gpus-per-node` allocates them and
sets CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE as on a GPU cluster."""
from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

from support import Proc, free_port, wait_until

NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "scancel")


def missing() -> list[str]:
    return [name for name in NEEDED if shutil.which(name) is None]


class Slurm:
    """`nodes` Slurm nodes of `gpus` GPUs each on this host, named n1, n2, ..."""

    def __init__(self, root: Path, nodes: int = 2, gpus: int = 2, cpus: int = 2):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)  # munged checks its socket's directory
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[Proc] = []
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = root / "munge.sock"
        host = socket.gethostname()
        for node in self.nodes:
            for g in range(gpus):
                device = root / f"{node}-gpu{g}"
                if not device.exists():  # a character device, as the NVIDIA ones are
                    os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (root / "gres.conf").write_text("AutoDetect=off\n" + "".join(
            f"NodeName={node} Name=gpu File={root}/{node}-gpu[0-{gpus - 1}]\n"
            for node in self.nodes))
        lines = [
            "ClusterName=dflash-test", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={self.socket}", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
            "MpiDefault=none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "GresTypes=gpu", "ReturnToService=2", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "MinJobAge=300",
            # Slurm's defaults: the grace a cancelled or requeued step gets after SIGTERM
            "KillWait=30",
            *(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()}"
              f" CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN" for node in self.nodes),
            f"PartitionName=main Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE"
            " State=UP OverSubscribe=YES"]
        self.conf.write_text("\n".join(lines) + "\n")
        for folder in ("state", "spool", *(f"spool/{n}" for n in self.nodes)):
            (root / folder).mkdir(parents=True, exist_ok=True)

    def start(self) -> "Slurm":
        self.procs.append(Proc(["munged", "-F", "-f", f"--socket={self.socket}",
                                f"--key-file={self.root}/munge.key",
                                f"--log-file={self.root}/munged.log",
                                f"--pid-file={self.root}/munged.pid",
                                f"--seed-file={self.root}/munged.seed"], self.root / "munged.out"))
        wait_until(self.socket.exists, timeout=20, what="munged's socket")
        self.procs.append(Proc(["slurmctld", "-D", "-f", str(self.conf)],
                               self.root / "slurmctld.out", env=self.env))
        for node in self.nodes:
            self.procs.append(Proc(["slurmd", "-D", "-f", str(self.conf), "-N", node],
                                   self.root / f"slurmd-{node}.out", env=self.env))
        wait_until(lambda: self.idle() == len(self.nodes), timeout=60, interval=0.5,
                   what=f"{len(self.nodes)} idle Slurm nodes ({self.root}/slurmctld.log)")
        return self

    def run(self, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), env={**self.env, **kwargs.pop("env", {})},
                                capture_output=True, text=True, timeout=60, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n"
                                 f"{result.stdout}\n{result.stderr}")
        return result

    def idle(self) -> int:
        out = self.run("sinfo", "-h", "-o", "%T %D", check=False).stdout.split()
        return sum(int(n) for state, n in zip(out[::2], out[1::2]) if state == "idle")

    def job_state(self, job: str) -> str:
        return self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()

    def steps(self, job: str) -> dict[str, str]:
        """The job's running steps: node -> step id (`<job>.<n>`)."""
        out = self.run("squeue", "-h", "-s", "-j", job, "-o", "%i %N", check=False).stdout
        return {node: step for step, node in (line.split() for line in out.splitlines())
                if not step.endswith(".batch") and not step.endswith(".extern")}

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], env=self.env, capture_output=True,
                       timeout=30)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.5)
        for proc in reversed(self.procs):
            proc.stop(timeout=20)
