"""Engine images this project brought that no engine uses any more: removed after a grace, never anyone else's.

A pruning ``engine_set`` (the agent's reconcile, or a playbook's ``prune: true`` with an ``owner``), once every
listed engine converged, looks at the images it may remove:

- images its ``owner``'s runs pulled (root's record, ``engines.image_record``), and
- for a signed desired state (the agent's run), images loaded from an air-gap bundle, known by the one tag a
  load gives them, ``<repo>:meridian-<first 16 hex of the image id>`` (``airgap.image_archive.load_tag``), in a
  repository the host's policy allows: only the agent loads bundle images, so only its state may prune them,
  and a repository the policy does not allow holds no engine of this host (another tenant's, on a shared
  Docker Engine).

Of those it keeps every image that is still wanted: one a listed engine names, one any container on the host
was created from (running or not, ours or not: Docker refuses to remove those too), and one that carries any
other tag or repository digest than ours (an operator tagged or pulled it too: it is theirs as much as ours,
and Docker would only untag). The rest are unused: the first prune that finds one so writes the time into the
record, and a prune ``images.prune_grace_seconds`` later (default one day) removes it, by id and never forced.
An image used again before then has its time cleared.

``plan_image_prune`` decides, as data, from what was read; ``prune_images`` reads, plans and acts. Check mode
plans the same and neither writes the record nor removes anything: its ``removed`` are what a real run would
remove now, and an image it would start the grace of is reported waiting the whole grace.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.meridian.node.plugins.module_utils._errors import MeridianError
from ansible_collections.meridian.node.plugins.module_utils.docker.api import DockerApiError
from ansible_collections.meridian.node.plugins.module_utils.docker.engine import DockerEngine
from ansible_collections.meridian.node.plugins.module_utils.engines.image_record import (
    BroughtImage,
    read_image_record,
    write_image_record,
)

__all__ = ["ImagePlan", "ImagePruneError", "ListedImage", "plan_image_prune", "prune_images", "record_pulled"]

# The tag airgap.image_archive.load_tag gives a loaded image (engines/ does not import airgap/: the rule is short).
_LOAD_TAG = re.compile(r"^(?P<repository>.+):meridian-(?P<id16>[0-9a-f]{16})$")


class ImagePruneError(MeridianError):
    """The image prune could not read or change what it needs; the message names the image and the reason."""


@dataclass(frozen=True)
class ListedImage:
    """One image as Docker lists it (``GET /images/json``)."""

    id: str
    repo_tags: tuple[str, ...]
    repo_digests: tuple[str, ...]


@dataclass
class ImagePlan:
    """What one prune does: ``remove`` (ids), ``waiting`` (id -> seconds of grace left), ``kept`` (id -> why),
    and ``record``: root's record as it must be afterwards (``record_changed`` when it differs)."""

    remove: list[str] = field(default_factory=list)
    waiting: dict[str, float] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    record: dict[str, BroughtImage] = field(default_factory=dict)
    record_changed: bool = False


def loaded_tag(image: ListedImage) -> str | None:
    """The ``meridian-<id16>`` tag a bundle load gave ``image``, if it has one that matches its own id."""
    for tag in image.repo_tags:
        match = _LOAD_TAG.match(tag)
        if match and image.id.startswith(f"sha256:{match.group('id16')}"):
            return tag
    return None


def _foreign_names(image: ListedImage, ours: BroughtImage) -> list[str]:
    """Tags and digests of ``image`` that no load or pull of ours gave it."""
    repository = ours.reference.split("@", 1)[0]
    foreign = [tag for tag in image.repo_tags if tag != loaded_tag(image)]
    foreign += [digest for digest in image.repo_digests if digest.split("@", 1)[0] != repository]
    return foreign


def plan_image_prune(
    record: Mapping[str, BroughtImage],
    images: Sequence[ListedImage],
    in_use: Iterable[str],
    *,
    owner: str,
    loaded_too: bool,
    now: float,
    grace_s: float,
    allowed: Callable[[str], bool] = lambda _repository: True,
) -> ImagePlan:
    """Decide, from root's ``record``, Docker's ``images`` and the image ids ``in_use`` (listed engines' images
    and every container's), what ``owner``'s prune removes now and what waits. ``allowed``: whether the policy
    allows a loaded image's repository (others are never candidates). Pure."""
    used = set(in_use)
    present = {image.id: image for image in images}
    plan = ImagePlan(record=dict(record))
    for image_id in [key for key in record if key not in present]:
        # Gone from Docker (removed by hand, or by another owner's prune): nothing to remember it for.
        del plan.record[image_id]
        plan.record_changed = True
    candidates: dict[str, BroughtImage] = {
        key: entry for key, entry in plan.record.items() if entry.brought == "pulled" and entry.owner == owner
    }
    if loaded_too:
        for image in images:
            tag = loaded_tag(image)
            if tag is None or not allowed(tag.rsplit(":", 1)[0]):
                continue
            entry = plan.record.get(image.id) or BroughtImage(image.id, tag, owner=None, brought="loaded")
            if entry.brought == "loaded":
                candidates[image.id] = entry
    for image_id in sorted(candidates):
        entry, image = candidates[image_id], present[image_id]
        why = "in use" if image_id in used else ""
        foreign = _foreign_names(image, entry)
        if not why and foreign:
            why = "also named " + ", ".join(sorted(foreign)) + ", which this project did not give it"
        if why:
            plan.kept[image_id] = why
            _set_unused(plan, entry, None)
            continue
        since = now if entry.unused_since is None else entry.unused_since
        _set_unused(plan, entry, since)
        left = since + grace_s - now
        if left <= 0:
            plan.remove.append(image_id)
        else:
            plan.waiting[image_id] = round(left, 3)
    return plan


def _set_unused(plan: ImagePlan, entry: BroughtImage, since: float | None) -> None:
    known = plan.record.get(entry.image_id)
    if known is None and since is None:
        return  # a loaded image in use: nothing to remember until it is unused
    if known is None or known.unused_since != since:
        plan.record[entry.image_id] = entry.unused_from(since)
        plan.record_changed = True


def local_images(engine: DockerEngine) -> list[ListedImage]:
    try:
        listed = engine.api.images({})
    except DockerApiError as exc:
        raise ImagePruneError(f"Error listing images for the image prune: {exc}") from exc
    return [
        ListedImage(
            id=str(entry.get("Id")),
            repo_tags=tuple(tag for tag in entry.get("RepoTags") or () if tag != "<none>:<none>"),
            repo_digests=tuple(digest for digest in entry.get("RepoDigests") or () if digest != "<none>@<none>"),
        )
        for entry in listed
    ]


def prune_images(
    engine: DockerEngine,
    *,
    state_dir: str,
    owner: str,
    loaded_too: bool,
    in_use: Iterable[str],
    now: float,
    grace_s: float,
    check_mode: bool,
    allowed: Callable[[str], bool] = lambda _repository: True,
) -> dict[str, Any]:
    """Plan and (unless ``check_mode``) act: write the record, remove each image due. Returns the result's
    ``images`` entry: ``removed`` and ``waiting`` as references with ids (``seconds_left`` for each waiting),
    and ``changed``: whether an image was (check mode: would be) removed."""
    record = read_image_record(state_dir)
    plan = plan_image_prune(
        record,
        local_images(engine),
        in_use,
        owner=owner,
        loaded_too=loaded_too,
        now=now,
        grace_s=grace_s,
        allowed=allowed,
    )
    named = {**record, **plan.record}
    removed: list[dict[str, Any]] = []
    for image_id in plan.remove:
        if not check_mode:
            try:
                engine.api.remove_image(image_id)
            except DockerApiError as exc:
                if not exc.not_found:
                    # Docker's own refusal (a container created meanwhile, a tag added meanwhile): keep the mark,
                    # fail nothing else; the next prune looks again.
                    plan.kept[image_id] = f"Docker refused to remove it: {exc}"
                    continue
            plan.record.pop(image_id, None)
            plan.record_changed = True
        removed.append({"image_id": image_id, "reference": named[image_id].reference})
    if plan.record_changed and not check_mode:
        write_image_record(state_dir, plan.record)
    waiting = [
        {"image_id": key, "reference": named[key].reference, "seconds_left": left}
        for key, left in sorted(plan.waiting.items())
    ]
    return {"changed": bool(removed), "removed": removed, "waiting": waiting}


def record_pulled(engine: DockerEngine, state_dir: str, owner: str, references: Sequence[str]) -> None:
    """Write the images just pulled for ``owner`` into root's record (by their local image id)."""
    if not references:
        return
    record = read_image_record(state_dir)
    for reference in references:
        try:
            image_id = engine.resolve_image(reference).id
        except MeridianError as exc:
            raise ImagePruneError(f"Error recording the pulled image {reference!r}: {exc}") from exc
        known = record.get(image_id)
        if known is None or known.owner != owner:
            # One owner per image: the last puller's. Another owner's listed engine keeps it in use anyway.
            record[image_id] = BroughtImage(image_id, reference, owner=owner, brought="pulled")
    write_image_record(state_dir, record)
