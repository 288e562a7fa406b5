"""The base of the wrapper's collaborators that use its reducer and process
group."""


class Bound:
    """bind() points a collaborator at the wrapper's reducer and process
    group: at construction, when the group changes (_update_process_group),
    and in an unpickled copy, whose pickle left both out."""

    reducer = None
    process_group = None

    def bind(self, reducer, process_group) -> None:
        self.reducer = reducer
        self.process_group = process_group

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("reducer", None)
        state.pop("process_group", None)
        return state
