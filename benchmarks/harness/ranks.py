"""What both launchers return or raise once their ranks are done."""

from typing import Any, Dict, List, Tuple


class RanksFailed(RuntimeError):
    pass


def values_in_rank_order(outcomes: Dict[int, Tuple[bool, Any]], world_size: int, failure: str,
                         missing_text: str, failed_anyway: bool = False) -> List[Any]:
    """The ranks' return values from `outcomes` (rank -> (ok, value or
    traceback)); raises RanksFailed, headed `failure`, if a rank failed, if
    ranks are missing (said with `missing_text`) or if `failed_anyway`."""
    failed = [f"--- rank {r} ---\n{value}" for r, (ok, value) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if failed or missing or failed_anyway:
        message = "\n".join(failed)
        if missing:
            message += f"\nranks {missing} {missing_text}"
        raise RanksFailed(f"{failure}:\n{message}")
    return [outcomes[r][1] for r in range(world_size)]
