//! The divvy line protocol over real sockets (SPEC §1): every row of the
//! error table, quoting, `\r\n`, pipelining order, close after `ERR` with
//! nothing after it executed, and the README's walkthrough.

use crate::util;

use std::io::{Read, Write};
use util::{converse, request, TestServer};

// Every test here runs against both serving loops: epoll and io_uring.
crate::in_both_serving_modes!(
    every_error_row_of_the_spec_answers_exact_bytes_and_closes,
    quoting_crlf_and_case_insensitive_commands,
    pipelined_requests_are_answered_in_order_in_one_write,
    nothing_after_an_error_is_executed,
    partial_line_at_close_is_not_executed,
    lone_cr_is_whitespace_inside_a_line,
    readme_walkthrough_transcript,
    canary_rules_consume_quota_but_the_stop_rule_answers,
    peek_answers_like_hit_without_consuming,
    actors_are_never_interpreted_and_missing_actor_is_empty,
    invalid_utf8_is_read_lossily_and_answered,
);

fn every_error_row_of_the_spec_answers_exact_bytes_and_closes() {
    let server = TestServer::start_default();
    let table: &[(&str, &str)] = &[
        (
            "FOO\n",
            "ERR unknown-command \"Unrecognized command: FOO\"\n",
        ),
        (
            "foo bar\n",
            "ERR unknown-command \"Unrecognized command: FOO\"\n",
        ),
        ("\n", "ERR unknown-command \"Unrecognized command: \"\n"),
        ("   \n", "ERR unknown-command \"Unrecognized command: \"\n"),
        (
            " HIT a=b\n",
            "ERR unknown-command \"Unrecognized command: \"\n",
        ),
        (
            "HIT a\n",
            "ERR unknown \"Unexpected end of input string.\"\n",
        ),
        ("HIT a b\n", "ERR unknown \"Expected '=', found ' '\"\n"),
        (
            "HIT a=b=c\n",
            "ERR unknown \"Expected whitespace, found '='\"\n",
        ),
        (
            "HIT a=\"b\"c\n",
            "ERR unknown \"Expected whitespace, found 'c'\"\n",
        ),
        (
            "HIT \"a\n",
            "ERR unknown \"Unexpected end of quoted string.\"\n",
        ),
        (
            "\"HIT\n",
            "ERR unknown \"Unexpected end of quoted string.\"\n",
        ),
        (
            "HIT a=\"b\n",
            "ERR unknown \"Unexpected end of quoted string.\"\n",
        ),
    ];
    for (input, expected) in table {
        // The server closes after the ERR even though the client keeps its side open.
        let mut stream = server.connect();
        stream.write_all(input.as_bytes()).unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        assert_eq!(&answer, expected, "input {input:?}");
    }
}

fn quoting_crlf_and_case_insensitive_commands() {
    let server = TestServer::start_default();
    let answer = converse(
        server.addr,
        b"hit method=\"GET\" \"path\"=\"/status\"\r\nHit method=GET path=/status\r\nHIT\tmethod=GET  path=/status \r\n",
    );
    assert_eq!(answer, "OK true 999 60\nOK true 998 60\nOK true 997 60\n");
}

fn pipelined_requests_are_answered_in_order_in_one_write() {
    let server = TestServer::start_ini(
        "[op=a]\ncreditLimit=2\nresetSeconds=60\n[op=b]\ncreditLimit=0\n[default]\ncreditLimit=5\nresetSeconds=0\n",
    );
    let mut input = String::new();
    let mut expected = String::new();
    for i in 0..300 {
        match i % 3 {
            0 => input.push_str("HIT op=a\n"),
            1 => input.push_str("HIT op=b\n"),
            _ => input.push_str("HIT op=c\n"),
        }
        expected.push_str(match (i % 3, i) {
            (0, 0) => "OK true 1 60\n",
            (0, 3) => "OK true 0 60\n",
            (0, _) => "OK false 0 60\n",
            (1, _) => "OK false 0 -1\n",
            _ => "OK true 5 0\n",
        });
    }
    assert_eq!(converse(server.addr, input.as_bytes()), expected);
}

fn nothing_after_an_error_is_executed() {
    let server = TestServer::start_ini(
        "[op=a]\ncreditLimit=10\nresetSeconds=60\n[default]\ncreditLimit=0\n",
    );
    let answer = converse(
        server.addr,
        b"HIT op=a\nHIT op=a\nBOGUS\nHIT op=a\nHIT op=a\n",
    );
    assert_eq!(
        answer,
        "OK true 9 60\nOK true 8 60\nERR unknown-command \"Unrecognized command: BOGUS\"\n"
    );
    // The two lines after the error consumed nothing.
    let mut stream = server.connect();
    assert_eq!(request(&mut stream, "PEEK op=a"), "OK true 7 60");
    assert_eq!(request(&mut stream, "HIT op=a"), "OK true 7 60");
}

fn partial_line_at_close_is_not_executed() {
    let server = TestServer::start_ini(
        "[op=a]\ncreditLimit=10\nresetSeconds=60\n[default]\ncreditLimit=0\n",
    );
    assert_eq!(
        converse(server.addr, b"HIT op=a\nHIT op=a"),
        "OK true 9 60\n"
    );
    let mut stream = server.connect();
    assert_eq!(request(&mut stream, "HIT op=a"), "OK true 8 60");
}

fn lone_cr_is_whitespace_inside_a_line() {
    let server = TestServer::start_default();
    assert_eq!(
        converse(server.addr, b"HIT method=GET\rpath=/status\n"),
        "OK true 999 60\n"
    );
}

fn readme_walkthrough_transcript() {
    let server = TestServer::start_default();
    let mut stream = server.connect();
    assert_eq!(
        request(&mut stream, "HIT method=GET path=/status"),
        "OK true 999 60"
    );
    assert_eq!(
        request(&mut stream, "HIT method=GET path=/status"),
        "OK true 998 60"
    );
    let cookie = "HIT method=GET path=/pantry/cookies/chocolate-chip ip=192.168.1.1";
    assert_eq!(request(&mut stream, cookie), "OK true 2 3600");
    assert_eq!(request(&mut stream, cookie), "OK true 1 3600");
    assert_eq!(
        request(
            &mut stream,
            "HIT method=GET path=/pantry/cookies/oatmeal ip=192.168.1.1"
        ),
        "OK true 0 3600"
    );
    assert_eq!(
        request(
            &mut stream,
            "HIT method=GET path=/pantry/cookies/cricket-flavored ip=192.168.1.1"
        ),
        "OK false 0 3600"
    );
    assert_eq!(
        request(
            &mut stream,
            "HIT method=GET path=/pantry/cookies/oatmeal ip=4.3.2.1"
        ),
        "OK true 2 3600"
    );
    assert_eq!(
        request(&mut stream, "HIT method=POST path=/anything"),
        "OK false 0 -1"
    );
}

fn canary_rules_consume_quota_but_the_stop_rule_answers() {
    let server = TestServer::start_ini(
        r#"
[method=GET path=/pantry/cookies/special-cookie]
creditLimit = 1
resetSeconds = 86400
matchPolicy = canary  # canary this rule
label = special

[method=GET path=/pantry/cookies/* ip=*]
creditLimit = 3
resetSeconds = 3600
actorField = ip

[default]
creditLimit = 2
resetSeconds = 60
matchPolicy = canary
"#,
    );
    let mut stream = server.connect();
    let special = "HIT method=GET path=/pantry/cookies/special-cookie ip=192.168.1.1";
    assert_eq!(request(&mut stream, special), "OK true 2 3600");
    assert_eq!(request(&mut stream, special), "OK true 1 3600");
    assert_eq!(request(&mut stream, special), "OK true 0 3600");
    assert_eq!(request(&mut stream, special), "OK false 0 3600");
    // Only the canary default matches: its own result is the answer.
    assert_eq!(request(&mut stream, "HIT a=1"), "OK true 1 60");
    assert_eq!(request(&mut stream, "HIT a=1"), "OK true 0 60");
    assert_eq!(request(&mut stream, "HIT a=1"), "OK false 0 60");
    let labels = server.engine.metrics.labels();
    let special_counts = &labels.iter().find(|(l, _)| l == "special").unwrap().1;
    use tollgate::metrics::HitStatus;
    assert_eq!(special_counts.get(HitStatus::CanaryAccepted), 1);
    assert_eq!(special_counts.get(HitStatus::CanaryRejected), 3);
}

fn peek_answers_like_hit_without_consuming() {
    let server =
        TestServer::start_ini("[op=a]\ncreditLimit=2\nresetSeconds=60\n[default]\ncreditLimit=0\n");
    let mut stream = server.connect();
    assert_eq!(request(&mut stream, "PEEK op=a"), "OK true 1 60");
    assert_eq!(request(&mut stream, "PEEK op=a"), "OK true 1 60");
    assert_eq!(request(&mut stream, "HIT op=a"), "OK true 1 60");
    assert_eq!(request(&mut stream, "PEEK op=a"), "OK true 0 60");
    assert_eq!(request(&mut stream, "HIT op=a"), "OK true 0 60");
    assert_eq!(request(&mut stream, "PEEK op=a"), "OK false 0 60");
    assert_eq!(request(&mut stream, "PEEK op=zzz"), "OK false 0 -1");
}

fn actors_are_never_interpreted_and_missing_actor_is_empty() {
    let server = TestServer::start_ini(
        "[op=a]\ncreditLimit=1\nresetSeconds=60\nactorField=user\n[default]\ncreditLimit=0\n",
    );
    let mut stream = server.connect();
    assert_eq!(request(&mut stream, "HIT op=a user=Bob"), "OK true 0 60");
    assert_eq!(request(&mut stream, "HIT op=a user=bob"), "OK true 0 60");
    assert_eq!(request(&mut stream, "HIT op=a user=Bob"), "OK false 0 60");
    assert_eq!(request(&mut stream, "HIT op=a"), "OK true 0 60");
    assert_eq!(request(&mut stream, "HIT op=a user="), "OK false 0 60");
}

fn invalid_utf8_is_read_lossily_and_answered() {
    let server =
        TestServer::start_ini("[op=a]\ncreditLimit=1\nresetSeconds=60\n[default]\ncreditLimit=0\n");
    assert_eq!(
        converse(server.addr, b"HIT op=\xff\xfe\nFOO\xff\n"),
        "OK false 0 -1\nERR unknown-command \"Unrecognized command: FOO\u{fffd}\"\n"
    );
}
