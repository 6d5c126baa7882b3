"""`nest-fx profile` and `nest-fx plan --profile`."""

import json

from nest_fx.cli import main

TINY = "gpt:hidden=64,layers=3,heads=4,seq=32,vocab=256"


def test_profile_then_plan_with_it(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "profile",
                TINY,
                "--out",
                str(out),
                "--device",
                "cpu",
                "--tp",
                "1,2",
                "--mbs",
                "1",
                "--dtype",
                "fp32",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--quiet",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "layers.0" in text and "wrote" in text
    data = json.loads(out.read_text())
    assert data["format"] == "nest-fx-profile/1" and data["ops"]
    assert (
        main(
            [
                "plan",
                "--model",
                TINY,
                "--cluster",
                "cpu-gloo:2",
                "--dtype",
                "fp32",
                "--profile",
                str(out),
                "--global-batch",
                "4",
                "--no-baselines",
                "--quiet",
                "--time-budget",
                "10",
            ]
        )
        == 0
    )
    assert "% measured" in capsys.readouterr().out


def test_profile_user_errors(tmp_path, capsys):
    cases = [
        (["profile", "--out", str(tmp_path / "x.json")], "give a MODEL"),
        (["profile", "--calibrate", "--out", str(tmp_path / "x.yaml")], "--calibrate needs --cluster"),
        (["profile", "no-such-model", "--out", str(tmp_path / "x.json"), "--device", "cpu"], "unknown model"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "nest-fx-profile/0"}')
    assert (
        main(
            [
                "plan",
                "--model",
                TINY,
                "--cluster",
                "cpu-gloo:2",
                "--dtype",
                "fp32",
                "--profile",
                str(bad),
                "--no-baselines",
                "--quiet",
            ]
        )
        == 2
    )
    assert "nest-fx-profile/1" in capsys.readouterr().err
