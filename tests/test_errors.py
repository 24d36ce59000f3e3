from alloy.errors import HTTP_STATUS, AlloyError, ErrorCode


def test_every_code_has_a_status():
    assert set(HTTP_STATUS) == set(ErrorCode)


def test_wire_shape_and_pickling_roundtrip():
    import pickle

    error = AlloyError("MODEL_NOT_FOUND", "no such model", {"model_id": "x"})
    assert error.http_status == 404
    assert error.to_dict("req-1") == {
        "error": {"code": "MODEL_NOT_FOUND", "message": "no such model", "details": {"model_id": "x"}, "request_id": "req-1"}
    }
    clone = pickle.loads(pickle.dumps(error))  # our own object crossing Ray's process boundary, not user data
    assert clone.code is ErrorCode.MODEL_NOT_FOUND and clone.details == {"model_id": "x"}
