"""What a step between hosts is: a strict request that names its verb and its answer's type.

A step is one thing the coordinator asks of the host a unit runs on (dump this tree, stage
these layers). ``DumpStep(Step[DumpAnswer])`` is both the request document and the contract:
``UnitHosts.call(unit, DumpStep(...))`` returns a ``DumpAnswer``, checked by mypy at every
call site and validated by pydantic at both ends of the wire.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sparkrun_coldsnap.documents.strict import Strict


class Answer(Strict):
    """What a host answers to one step; strict, so a missing or unknown field is refused."""


class Step[AnswerT: Answer](Strict):
    """One step's request. Subclasses set ``verb`` and parametrize the base with their answer."""

    #: the step's name on the wire (and in error messages)
    verb: ClassVar[str]

    @classmethod
    def answer_type(cls) -> type[AnswerT]:
        """The answer model this step names in ``Step[...]``."""
        for base in cls.__mro__:
            meta = getattr(base, "__pydantic_generic_metadata__", None)
            if meta and meta.get("origin") is Step and meta.get("args"):
                answer: type[AnswerT] = meta["args"][0]
                return answer
        raise TypeError("step %s names no answer type: derive it from Step[TheAnswer]" % cls.__name__)

    def read_answer(self, doc: Any) -> AnswerT:
        """*doc* (a decoded JSON object) as this step's answer; pydantic's error when it is not one."""
        return self.answer_type().model_validate(doc)


class Empty(Answer):
    """The answer of a step that reports nothing but its success."""
