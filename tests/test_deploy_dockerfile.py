"""deploy/kuberay/Dockerfile builds: the image's own user can do every step, and the
project's wheels can only come from this checkout.

Two rules are checked statically on every run (no container builder needed):

- a file copied into a stage and removed later is removed by a user who may: root, or
  the owner the copy gave it (`COPY --chown`). Ray's images run as uid 1000 and COPY
  makes root-owned files, so a plain COPY then `rm` as the base image's user fails.
- every `pip install` of the project's packages (from a wheel folder, or naming the role's
  package or an `rlax-*` distribution) passes `--no-index`, so a same-named package on
  the index cannot win; and the wheel folder it reads is there in that step (copied
  earlier in the stage, or mounted by the step).

Where docker or podman can build (`docker info` answers), the slow test builds the image
for real on a stand-in for Ray's image (a uid-1000 user owning its Python), installs
the parameter server's package, and runs its entry point.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex
import shutil
import subprocess
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy/kuberay/Dockerfile"
ROOT_USERS = {"root", "0", "0:0", "root:root"}
# Who a stage runs as when its Dockerfile sets no USER: Ray's images run as their `ray`
# user (uid 1000); python's official images as root. Unknown bases count as non-root.
BASE_USERS = {"rayproject/ray": "1000", "python": "root"}


@dataclasses.dataclass
class Instruction:
    line: int
    keyword: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    result: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line = pending + stripped
        pending = ""
        keyword, _, args = line.partition(" ")
        result.append(Instruction(start, keyword.upper(), args.strip()))
    return result


def _user_part(user: str) -> str:
    return user.split(":", 1)[0]


def _same_user(a: str, b: str) -> bool:
    names = {"ray": "1000"}
    a, b = _user_part(a), _user_part(b)
    return names.get(a, a) == names.get(b, b)


def _base_user(image: str, args: dict[str, str]) -> str:
    image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), image)
    name = image.split("@", 1)[0].rsplit(":", 1)[0] if "/" in image or ":" in image else image
    return BASE_USERS.get(name, "unknown non-root user")


def _commands(run_args: str) -> list[list[str]]:
    """The simple commands of a RUN's shell line (split at &&, ||, ;, |)."""
    body = re.sub(r"--mount=\S+", "", run_args)
    commands: list[list[str]] = []
    for part in re.split(r"&&|\|\||;|\|", body):
        words = shlex.split(part, posix=True) if part.strip() else []
        if words:
            commands.append(words)
    return commands


def _mount_targets(run_args: str) -> list[str]:
    targets = []
    for mount in re.findall(r"--mount=(\S+)", run_args):
        fields = dict(f.split("=", 1) for f in mount.split(",") if "=" in f)
        if "target" in fields or "dst" in fields or "destination" in fields:
            targets.append(fields.get("target") or fields.get("dst") or fields["destination"])
    return targets


def _under(path: str, folder: str) -> bool:
    path, folder = path.rstrip("/"), folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


def check_dockerfile(text: str) -> list[str]:
    """Every problem of a Dockerfile under the two rules (empty: none)."""
    problems: list[str] = []
    global_args: dict[str, str] = {}
    stage_names: set[str] = set()
    user = "root"
    copied: list[tuple[str, str]] = []  # (destination, owner) in the current stage
    in_stage = False
    for ins in instructions(text):
        where = f"line {ins.line}"
        if ins.keyword == "ARG" and not in_stage:
            name, _, default = ins.args.partition("=")
            global_args[name.strip()] = default.strip().strip("'\"")
        elif ins.keyword == "FROM":
            words = ins.args.split()
            words = [w for w in words if not w.startswith("--")]
            image = words[0]
            if len(words) >= 3 and words[1].upper() == "AS":
                stage_names.add(words[2])
            user = "root" if image in stage_names else _base_user(image, global_args)
            copied = []
            in_stage = True
        elif ins.keyword == "USER":
            user = ins.args.split()[0]
        elif ins.keyword in ("COPY", "ADD"):
            words = shlex.split(ins.args)
            chown = next((w.split("=", 1)[1] for w in words if w.startswith("--chown=")), "root")
            paths = [w for w in words if not w.startswith("--")]
            if paths:
                copied.append((paths[-1], chown))
        elif ins.keyword == "RUN":
            mounts = _mount_targets(ins.args)
            for words in _commands(ins.args):
                program = pathlib.PurePosixPath(words[0]).name
                if program == "rm":
                    for target in (w for w in words[1:] if not w.startswith("-")):
                        for destination, owner in copied:
                            if not (_under(target, destination) or _under(destination, target)):
                                continue
                            if _user_part(user) in ROOT_USERS or _same_user(owner, user):
                                continue
                            problems.append(
                                f"{where}: `rm {target}` runs as {user}, but {destination} was "
                                f"copied in owned by {owner} (use COPY --chown={user.split(':')[0]} "
                                f"or remove it as root, or mount it instead of copying)"
                            )
                is_pip = program in ("pip", "pip3") or (
                    program.startswith("python") and words[1:3] == ["-m", "pip"]
                )
                if not is_pip:
                    continue
                rest = words[1:] if program in ("pip", "pip3") else words[3:]
                if not rest or rest[0] != "install":
                    continue
                links = [rest[i + 1] for i, w in enumerate(rest[:-1]) if w in ("--find-links", "-f")] + [
                    w.split("=", 1)[1] for w in rest if w.startswith("--find-links=")
                ]
                ours = links or any(w.startswith(("rlax-", "rlax_")) or "ROLE_PACKAGE" in w for w in rest)
                if ours and "--no-index" not in rest:
                    problems.append(
                        f"{where}: `pip install` of the project's packages without --no-index "
                        "(a same-named package on the index could be installed instead)"
                    )
                for folder in links:
                    available = any(_under(folder, d) for d, _ in copied) or any(
                        _under(folder, m) for m in mounts
                    )
                    if not available:
                        problems.append(f"{where}: --find-links {folder} is neither copied nor mounted")
    return problems


# The Dockerfile as it was before issue 30: COPY as root, rm as Ray's uid 1000, and
# --find-links with the index still on.
OLD_DOCKERFILE = """\
ARG BASE=rayproject/ray:2.60.0-py311
FROM python:3.11-slim AS wheels
WORKDIR /src
COPY packages packages
COPY kernels kernels
RUN pip wheel --no-deps --wheel-dir /wheels packages/* kernels

FROM ${BASE}
ARG ROLE_PACKAGE
ARG EXTRA=""
COPY --from=wheels /wheels /tmp/rlax-wheels
RUN pip install --no-cache-dir --find-links /tmp/rlax-wheels "${ROLE_PACKAGE}" rlax-core ${EXTRA} \\
    && rm -rf /tmp/rlax-wheels
"""


def test_the_shipped_dockerfile_keeps_both_rules() -> None:
    assert check_dockerfile(DOCKERFILE.read_text()) == []


def test_the_shipped_dockerfile_installs_the_role_package_from_its_wheels_only() -> None:
    runs = [i for i in instructions(DOCKERFILE.read_text()) if i.keyword == "RUN"]
    installs = [words for i in runs for words in _commands(i.args) if words[:2] == ["pip", "install"]]
    assert len(installs) == 1, installs
    assert {"--no-index", "--find-links", "${ROLE_PACKAGE}"} <= set(installs[0])


def test_the_old_dockerfile_breaks_both_rules() -> None:
    problems = check_dockerfile(OLD_DOCKERFILE)
    assert any("`rm /tmp/rlax-wheels` runs as 1000" in p for p in problems), problems
    assert any("without --no-index" in p for p in problems), problems


FIXED_BY = {
    "copied with --chown to Ray's user": (
        "COPY --from=wheels /wheels /tmp/rlax-wheels",
        "COPY --from=wheels --chown=1000:100 /wheels /tmp/rlax-wheels",
    ),
    "removed as root": (
        "COPY --from=wheels /wheels /tmp/rlax-wheels",
        "USER root\nCOPY --from=wheels /wheels /tmp/rlax-wheels",
    ),
}


@pytest.mark.parametrize("case", list(FIXED_BY), ids=list(FIXED_BY))
def test_either_ownership_fix_is_accepted(case: str) -> None:
    old, new = FIXED_BY[case]
    text = OLD_DOCKERFILE.replace(old, new).replace("--find-links", "--no-index --find-links")
    assert check_dockerfile(text) == []


BROKEN = {
    "index left on": (
        "pip install --no-cache-dir --no-index --find-links",
        "pip install --no-cache-dir --find-links",
        "without --no-index",
    ),
    "wheels neither copied nor mounted": (
        "--mount=type=bind,from=wheels,source=/wheels,target=/tmp/rlax-wheels",
        "",
        "neither copied nor mounted",
    ),
    "copied as root, removed as the base user": (
        "RUN --mount=type=bind,from=wheels,source=/wheels,target=/tmp/rlax-wheels \\\n",
        "COPY --from=wheels /wheels /tmp/rlax-wheels\nRUN rm -rf /tmp/rlax-wheels && \\\n",
        "runs as 1000",
    ),
    "chown to another user": (
        "RUN --mount=type=bind,from=wheels,source=/wheels,target=/tmp/rlax-wheels \\\n",
        "COPY --chown=2000 --from=wheels /wheels /tmp/rlax-wheels\nRUN rm -rf /tmp/rlax-wheels && \\\n",
        "owned by 2000",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN), ids=list(BROKEN))
def test_a_broken_copy_of_the_shipped_dockerfile_fails(case: str) -> None:
    old, new, expected = BROKEN[case]
    text = DOCKERFILE.read_text()
    assert old in text
    problems = check_dockerfile(text.replace(old, new))
    assert any(expected in p for p in problems), problems


def container_builder() -> str | None:
    """docker or podman, when it can build here (its daemon or service answers)."""
    for tool in ("docker", "podman"):
        exe = shutil.which(tool)
        if exe and subprocess.run([exe, "info"], capture_output=True, timeout=60).returncode == 0:
            return exe
    return None


# A stand-in for Ray's image: its Python belongs to a non-root uid 1000, which the image
# runs as (as rayproject/ray's does), so an install step that needs root fails here too.
RAY_LIKE_BASE = """\
FROM python:3.11-slim
RUN useradd --uid 1000 --create-home ray \\
    && python -m venv /home/ray/venv && chown -R ray: /home/ray/venv
ENV PATH=/home/ray/venv/bin:$PATH
USER 1000
WORKDIR /home/ray
"""


@pytest.mark.slow
def test_the_image_builds_and_runs_as_rays_user(tmp_path: pathlib.Path) -> None:
    """Where a builder answers: build the role image for real (it downloads the base
    images and every dependency's wheel) and start the parameter server's entry point in
    it. Elsewhere the static rules above are what can be checked, and are checked here."""
    builder = container_builder()
    if builder is None:
        assert check_dockerfile(DOCKERFILE.read_text()) == []
        return
    tag = f"rlax-test-{uuid.uuid4().hex[:12]}"
    (tmp_path / "Dockerfile").write_text(RAY_LIKE_BASE)
    images = [f"{tag}-base", f"{tag}-paramserver"]
    try:
        subprocess.run([builder, "build", "-t", images[0], str(tmp_path)], check=True, timeout=1800)
        build = [
            builder, "build", "-f", str(DOCKERFILE), "--build-arg", f"BASE={images[0]}",
            "--build-arg", "ROLE_PACKAGE=rlax-paramserver", "-t", images[1], str(ROOT),
        ]  # fmt: skip
        subprocess.run(build, check=True, timeout=3600)
        probe = "id -u && test ! -e /tmp/rlax-wheels && rlax-paramserver --help >/dev/null && echo ok"
        out = subprocess.run(
            [builder, "run", "--rm", images[1], "sh", "-c", probe],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.stdout.split() == ["1000", "ok"], out.stdout
    finally:
        for image in reversed(images):
            subprocess.run([builder, "rmi", "-f", image], capture_output=True, timeout=300)
