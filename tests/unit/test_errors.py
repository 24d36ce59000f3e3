from alloy.errors import HTTP_STATUS, AlloyError, ErrorCode


def test_every_code_has_a_status():
    assert set(HTTP_STATUS) == set(ErrorCode)


def test_wire_shape_and_pickling_roundtrip():
    import pickle

    error = AlloyError("MODEL_NOT_FOUND", "no such model", {"model_id": "x"})
    assert error.http_status == 404
    assert error.to_dict("req-1") == {
        "error": {
            "code": "MODEL_NOT_FOUND",
            "message": "no such model",
            "details": {"model_id": "x"},
            "request_id": "req-1",
        }
    }
    clone = pickle.loads(pickle.dumps(error))  # our own object crossing Ray's process boundary, not user data
    assert clone.code is ErrorCode.MODEL_NOT_FOUND and clone.details == {"model_id": "x"}


def test_validation_error_names_the_first_field_and_lists_all():
    from pydantic import BaseModel, ValidationError

    from alloy.errors import from_validation_error

    class Request(BaseModel):
        a: int
        b: int

    try:
        Request.model_validate({"a": "x", "b": "y"})
    except ValidationError as exc:
        error = from_validation_error(exc, "invalid request", job="j1")
    assert error.code is ErrorCode.VALIDATION_FAILED
    assert error.message.startswith("invalid request: a: ")
    assert error.details["field"] == "a" and error.details["job"] == "j1"
    assert [e["field"] for e in error.details["errors"]] == ["a", "b"]
