"""The committed stubs must be exactly what the .proto sources generate."""

from pathlib import Path

from gpushare import protogen


def test_committed_stubs_match_proto_sources(tmp_path: Path) -> None:
    protogen.generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*") if p.is_file())
    assert generated, "protoc produced nothing"
    stale = [
        str(rel)
        for rel in generated
        if not (protogen.ROOT / rel).exists() or (protogen.ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"stale stubs, run `python -m gpushare.protogen`: {stale}"


def test_device_plugin_wire_names() -> None:
    from gpushare.pb import deviceplugin_pb2 as pb

    assert pb.DESCRIPTOR.package == "v1beta1"
    fields = pb.ContainerAllocateResponse.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in fields.items()} == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert pb.DESCRIPTOR.services_by_name["DevicePlugin"].methods_by_name["ListAndWatch"].server_streaming


def test_cri_wire_names() -> None:
    from gpushare.pb import cri_pb2 as pb

    assert pb.DESCRIPTOR.package == "runtime.v1"
    numbers = {n: f.number for n, f in pb.ContainerConfig.DESCRIPTOR.fields_by_name.items()}
    assert numbers["envs"] == 6 and numbers["devices"] == 8 and numbers["annotations"] == 10
    assert numbers["CDI_devices"] == 17 and numbers["stop_signal"] == 18
    request = {n: f.number for n, f in pb.CreateContainerRequest.DESCRIPTOR.fields_by_name.items()}
    assert request == {"pod_sandbox_id": 1, "config": 2, "sandbox_config": 3}
    sandbox = {n: f.number for n, f in pb.PodSandboxConfig.DESCRIPTOR.fields_by_name.items()}
    assert sandbox["labels"] == 6 and sandbox["annotations"] == 7
    runtime = pb.DESCRIPTOR.services_by_name["RuntimeService"].methods_by_name
    assert runtime["GetContainerEvents"].server_streaming
    assert runtime["CreateContainer"].input_type.name == "CreateContainerRequest"
    assert {"UpdatePodSandboxResources", "ListPodSandboxMetrics", "CheckpointContainer"} <= set(runtime)
    images = pb.DESCRIPTOR.services_by_name["ImageService"].methods_by_name
    assert set(images) == {"ListImages", "ImageStatus", "PullImage", "RemoveImage", "ImageFsInfo"}
