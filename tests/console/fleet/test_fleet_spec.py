"""The fleet as a value: `--hosts`, a fleet file, one line for every mistake, ssh's command line
with the operator's options first, what an ssh failure means, the hosts left out."""

from __future__ import annotations

import pytest

from console.fleet import spec as F
from console.fleet.ssh import Ssh, why
from store.errors import UserError


def test_hosts_are_node_ranks_in_order_with_users_and_ports():
    fleet = F.from_hosts("gpu-a,serve@gpu-b:2222,10.0.0.3")
    assert [(h.name, h.node_rank, h.user, h.port) for h in fleet.hosts] == [
        ("gpu-a", 0, None, None), ("gpu-b", 1, "serve", 2222), ("10.0.0.3", 2, None, None)]
    assert fleet.spec().ranks == 3  # one rank per host unless the launch says otherwise


@pytest.mark.parametrize(("text", "says"), [
    ("a,,b", "an empty host name"), ("a,a", "host a is named twice"), ("-oProxyCommand=x", "not a host name"),
    ("a:99999", "the port must be 1..65535"),
])
def test_bad_hosts_are_one_line(text, says):
    with pytest.raises(UserError, match=says):
        F.from_hosts(text)


@pytest.mark.parametrize(("body", "says"), [
    ("[[hosts]]\nname = 'a'\nflavour = 1\n", "unknown key 'flavour'"),
    ("[[hosts]]\nname = 'a'\nnode_rank = 1\n", r"node ranks must be 0..0, each once \(got \[1\]\)"),
    ("[[hosts]]\nname = 'a'\nport = 0\n", r"hosts\[0\].port: 1..65535"),
    ("[launch]\nbackend = 'fast'\n[[hosts]]\nname = 'a'\n", "refuses"),
    ("[launch]\nflavour = 1\n[[hosts]]\nname = 'a'\n", r"\[launch\] flavour: not a launch setting"),
    ("ssh_options = ['no-equals']\n[[hosts]]\nname = 'a'\n", "KEY=VALUE"),
    ("hosts = 3\n", "no hosts"), ("this is = not toml [", "not TOML"),
])
def test_a_bad_fleet_file_is_one_line_naming_the_file(tmp_path, body, says):
    path = tmp_path / "fleet.toml"
    path.write_text(body)
    with pytest.raises(UserError, match=says) as raised:
        F.load(path)
    assert str(path) in str(raised.value)


def test_a_fleet_file_says_hosts_launch_and_ssh(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text("ssh_options = ['ConnectTimeout=3']\nregistry = 'reg:5000/dsv4'\n"
                    "[launch]\nmodel = '/models/v4'\nbackend = 'export'\nranks = 4\nuse_sidecar = false\n"
                    "[[hosts]]\nname = 'b'\nnode_rank = 1\ndsv4 = '/opt/dsv4/bin/dsv4'\n"
                    "[[hosts]]\nname = 'a'\naddress = '10.0.0.1'\nnode_rank = 0\nssh_options = ['User=serve']\n")
    fleet = F.load(path)
    assert [h.name for h in fleet.hosts] == ["a", "b"]  # by node rank
    assert fleet.hosts[0].destination == "10.0.0.1" and fleet.hosts[1].dsv4 == "/opt/dsv4/bin/dsv4"
    spec = fleet.spec()
    assert (str(spec.model), spec.backend, spec.ranks, spec.use_sidecar) == ("/models/v4", "export", 4, False)
    assert fleet.registry == "reg:5000/dsv4"


def test_leaving_a_host_out_takes_its_share_of_the_ranks_and_names_must_be_hosts():
    fleet = F.from_hosts("a,b,c,d")
    spec = fleet.spec().with_(ranks=8)  # two a host
    assert fleet.service(spec, {"c"}).ranks == 6 and fleet.service(spec).ranks == 8
    assert fleet.checked_out(["c"]) == {"c"}
    with pytest.raises(UserError, match="--exclude e: not a host of --hosts"):
        fleet.checked_out(["e"])
    with pytest.raises(UserError, match="leaves no host"):
        fleet.checked_out(["a", "b", "c", "d"])
    assert fleet.split(spec.with_(ranks=3), 2) == "--ranks 3 does not split over 2 hosts; give a multiple of 2"


def test_ssh_takes_the_operators_options_first_and_shares_connections(tmp_path):
    host = F.FleetHost("a", 0, "10.0.0.1", "serve", 2222, ("ControlMaster=no",), "/opt/dsv4 bin/dsv4")
    argv = Ssh("/cfg", ("ConnectTimeout=2",), tmp_path).argv(host, "snapshot", "--model", "/m x")
    options = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert options[:2] == ["ControlMaster=no", "ConnectTimeout=2"]  # ssh keeps the first value it is given
    assert "BatchMode=yes" in options and f"ControlPath={tmp_path}/%C" in options
    assert argv[argv.index("-F") + 1] == "/cfg" and argv[argv.index("-p") + 1] == "2222"
    assert argv[-2:] == ["10.0.0.1", "'/opt/dsv4 bin/dsv4' snapshot --model '/m x'"]  # one shell line, quoted


def test_every_command_of_a_host_over_ssh_goes_through_its_one_shared_connection(tmp_path):
    from console.fleet.remote import SshHost

    host = SshHost(F.FleetHost("a", 0, "10.0.0.1"), Ssh(None, (), tmp_path))
    action = host.command("warm", ("compile", "/m")).argv
    feed = host.log("service", pid=7, rank=1)
    control = f"ControlPath={tmp_path}/%C"
    assert control in action and control in feed.command.argv
    assert action[-1] == "dsv4 compile /m" and feed.command.argv[-1] == "dsv4 service log --pid 7 --rank 1 --follow"


@pytest.mark.parametrize(("code", "stderr", "says"), [
    (255, ["root@h: Permission denied (publickey)."], "authentication failed"),
    (255, ["ssh: connect to host h port 22: Connection timed out"], "timeout"),
    (255, ["ssh: connect to host h port 22: Connection refused"], "connection refused"),
    (255, ["ssh: Could not resolve hostname h: Name or service not known"], "unknown host"),
    (127, ["sh: 1: dsv4: not found"], "dsv4 missing"),
    (1, ["dsv4 snapshot: something broke"], "dsv4 exited 1: dsv4 snapshot: something broke"),
])
def test_what_an_ssh_failure_means_is_one_line(code, stderr, says):
    assert says in why(F.FleetHost("h", 0), code, stderr)
